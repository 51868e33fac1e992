"""Pins in this engine: ``vllm_continuum.pins``' mechanism over our KV cache manager.

A pinned request keeps its blocks referenced in the KV cache manager until its pin ends
(``vllm_continuum.pins`` says when). What is this engine's own: a request's job is its
``job_key``; a pin that ends by TTL or pressure is offloaded to the CPU KV tier (when
there is one); every pin change is reported to the policy (``on_pinned`` /
``on_pin_released``), which also decides whether a request may take another job's pin
(``may_release_pin``). ``stats`` turns the totals into the per-report deltas of
``PinStats``.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.metrics.stats import PinStats
from vllm.v1.request import Request
from vllm_continuum.pins import (
    PIN_RELEASE_EXPIRED,
    PIN_RELEASE_PRESSURE,
    PinCounters,
    PinEntry,
    PinManager,
)
from vllm_continuum.policy import Policy

__all__ = ["KVCachePinManager", "PinEntry"]


class KVCachePinManager(PinManager):
    """The scheduler's pins: blocks held in (and freed through) ``KVCacheManager``."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        policy: Policy,
        job_pin_changed: Callable[[str], None] = lambda job: None,
    ) -> None:
        """``job_pin_changed(job)``: told when a job gains or loses a pin (the waiting
        queue re-ranks that job)."""
        super().__init__()
        self.kv = kv_cache_manager
        self.policy = policy
        self._job_pin_changed = job_pin_changed
        self._reported = PinCounters()

    def job_of(self, request: Request) -> str:
        return request.job_key

    def num_blocks_of(self, request: Request) -> int:
        return self.kv.get_num_blocks(request.request_id)

    def job_arrival_of(self, request: Request) -> float:
        return self.policy.job_arrival(request)

    def free_blocks(self, entry: PinEntry, reason: str) -> None:
        # A pin that ends without its hit (TTL, pressure) still names a context the job is
        # likely to resume: with a CPU KV tier it is offloaded rather than dropped.
        # A client that asked for in-memory retention only gets a plain free.
        offload = reason in (PIN_RELEASE_EXPIRED, PIN_RELEASE_PRESSURE)
        self.kv.free(entry.request, offload=offload and entry.request.sampling_params.may_offload)

    def may_release(self, requester: Request, entry: PinEntry, now: float) -> bool:
        return self.policy.may_release_pin(requester, entry.job_arrival, now)

    def on_pinned(self, entry: PinEntry, now: float) -> None:
        self._job_pin_changed(entry.job)
        self.policy.on_pinned(entry.request, now)

    def on_released(self, entry: PinEntry, now: float, reason: str) -> None:
        self._job_pin_changed(entry.job)
        self.policy.on_pin_released(entry.request, now, reason)

    def take_stats(self) -> PinStats:
        """The counters since the previous call, and the gauges now."""
        total, last = self.counters, self._reported
        stats = PinStats(
            num_pinned_requests=len(self.pinned),
            pinned_kv_blocks=self.pinned.num_blocks,
            pins=total.pins - last.pins,
            pin_hits=total.hits - last.hits,
            expiries=total.expiries - last.expiries,
            forced_releases=total.pressure_releases - last.pressure_releases,
        )
        self._reported = PinCounters(**vars(total))
        return stats
