"""The pin table: finished requests whose KV blocks are kept for their job's next turn.

Bookkeeping only (the scheduler frees the blocks): one pin per job, O(1) by job, a
deadline heap for expiry and a newest-job heap for pressure release, both with lazy
deletion, so a step never scans all pins. The same semantics as our engine's
``PinnedRequests`` (vllm/v1/core/sched/pinned.py).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Why a pin ended (the ``reason`` given to the policy core, as in our engine).
PIN_RELEASE_HIT = "hit"
PIN_RELEASE_EXPIRED = "expired"
PIN_RELEASE_PRESSURE = "pressure"
PIN_RELEASE_REPLACED = "replaced"
PIN_RELEASE_SHUTDOWN = "shutdown"


@dataclass
class PinEntry:
    request: Any  # the finished upstream Request: its blocks stay allocated under its id
    job: str
    deadline: float
    job_age: float  # the job's first arrival: higher is newer
    num_blocks: int
    seq: int = field(default=0)


@dataclass
class PinCounters:
    """Cumulative since start (the stat logger turns them into counter increments, so a
    dropped stats message loses nothing)."""

    pins: int = 0
    hits: int = 0
    expiries: int = 0
    pressure_releases: int = 0


class PinTable:
    def __init__(self) -> None:
        self._by_job: dict[str, PinEntry] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._newest: list[tuple[float, int, str]] = []  # (-job_age, seq, job)
        self._seq = itertools.count()
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._by_job)

    def __contains__(self, job: object) -> bool:
        return job in self._by_job

    def add(self, entry: PinEntry) -> PinEntry | None:
        """Register ``entry``; returns the job's previous pin (the caller frees it)."""
        old = self.remove(entry.job)
        entry.seq = next(self._seq)
        self._by_job[entry.job] = entry
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, entry.job))
        heapq.heappush(self._newest, (-entry.job_age, entry.seq, entry.job))
        self.num_blocks += entry.num_blocks
        return old

    def remove(self, job: str) -> PinEntry | None:
        entry = self._by_job.pop(job, None)
        if entry is not None:
            self.num_blocks -= entry.num_blocks
        return entry

    def _live(self, seq: int, job: str) -> bool:
        entry = self._by_job.get(job)
        return entry is not None and entry.seq == seq

    def expired(self, now: float) -> Iterator[PinEntry]:
        """Pins whose deadline passed, earliest first; each leaves the deadline heap (the
        caller removes it, or ``rearm``s it after the iteration to look again next step)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, job = heapq.heappop(self._deadlines)
            if self._live(seq, job):
                yield self._by_job[job]

    def rearm(self, entry: PinEntry) -> None:
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, entry.job))

    def newest_job(self, exclude: str | None = None) -> str | None:
        """The pinned job that arrived last, other than ``exclude`` if another exists."""
        skipped, found = [], None
        while self._newest:
            _, seq, job = self._newest[0]
            if not self._live(seq, job):
                heapq.heappop(self._newest)
            elif job == exclude:
                skipped.append(heapq.heappop(self._newest))
            else:
                found = job
                break
        for item in skipped:
            heapq.heappush(self._newest, item)
        return found if found is not None else (exclude if exclude in self else None)

    def next_deadline(self) -> float | None:
        while self._deadlines and not self._live(self._deadlines[0][1], self._deadlines[0][2]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def jobs(self) -> list[str]:
        return list(self._by_job)

    def entries(self) -> Iterator[PinEntry]:
        return iter(self._by_job.values())


# Keys of the pin figures in ``SchedulerStats.num_kv_fetch_reqs_by_stage`` (metrics.py).
STATS_PREFIX = "continuum:"
GAUGES = ("num_pinned_requests", "pinned_kv_blocks")
COUNTERS = ("pins", "pin_hits", "pin_expiries", "pin_pressure_releases")


def pin_stats(table: PinTable, counters: PinCounters) -> dict[str, int]:
    values = {
        "num_pinned_requests": len(table),
        "pinned_kv_blocks": table.num_blocks,
        "pins": counters.pins,
        "pin_hits": counters.hits,
        "pin_expiries": counters.expiries,
        "pin_pressure_releases": counters.pressure_releases,
    }
    return {STATS_PREFIX + k: v for k, v in values.items()}
