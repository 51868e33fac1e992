"""Pins on upstream's scheduler: ``vllm_continuum.pins``' mechanism over upstream's pool.

Upstream's own part: a request's job and arrival come from the scheduler's
``RequestInfo`` (the policy's view, read at arrival from ``vllm_xargs``), a pin's blocks
stay allocated under the finished request's id and go back through upstream's
``_free_request_blocks``, and the pin figures travel to the front end in
``SchedulerStats.num_kv_fetch_reqs_by_stage`` (``metrics.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_continuum.pins import PinCounters, PinEntry, PinManager, PinTable

if TYPE_CHECKING:
    from vllm_continuum.upstream.scheduler import PolicyScheduler


class UpstreamPinManager(PinManager):
    """The pins of one ``PolicyScheduler``; the decisions stay its policy's."""

    def __init__(self, scheduler: PolicyScheduler) -> None:
        super().__init__()
        self.scheduler = scheduler

    def job_of(self, request: Any) -> str:
        return self.scheduler.info_of(request).job_key

    def num_blocks_of(self, request: Any) -> int:
        return self.scheduler.num_blocks(request.request_id)

    def job_arrival_of(self, request: Any) -> float:
        return self.scheduler.job_arrival(self.scheduler.info_of(request))

    def free_blocks(self, entry: PinEntry, reason: str) -> None:
        self.scheduler._free_request_blocks(entry.request)  # upstream has no CPU tier here

    def may_release(self, requester: Any, entry: PinEntry, now: float) -> bool:
        return self.scheduler.may_release_pin(requester, entry, now)

    def on_pinned(self, entry: PinEntry, now: float) -> None:
        self.scheduler.on_pinned(entry, now)

    def on_released(self, entry: PinEntry, now: float, reason: str) -> None:
        self.scheduler.on_pin_released(entry, now, reason)


# Keys of the pin figures in ``SchedulerStats.num_kv_fetch_reqs_by_stage`` (metrics.py):
# the attributes ``vllm_continuum.pins.PIN_METRICS`` read, counters as totals since start.
STATS_PREFIX = "continuum:"


def pin_stats(table: PinTable, counters: PinCounters) -> dict[str, int]:
    values = {
        "num_pinned_requests": len(table),
        "pinned_kv_blocks": table.num_blocks,
        "pins": counters.pins,
        "pin_hits": counters.hits,
        "expiries": counters.expiries,
        "forced_releases": counters.pressure_releases,
    }
    return {STATS_PREFIX + k: v for k, v in values.items()}
