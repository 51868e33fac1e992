"""The pin mechanism, engine-agnostic: finished requests whose KV blocks are kept for their
job's next turn.

A pin ends when its job's next turn is admitted (a hit), when its TTL passes (unless the
job's turn is first in line: it is about to take its hit), under memory pressure (newest
job first, soft pins before strict ones, before anyone is preempted), when its job pins a
newer turn, and at shutdown. One pin per job.

``PinTable`` is the bookkeeping (O(1) by job; heaps with lazy deletion for expiry and the
pressure order, so a step never scans all pins). ``PinManager`` is the mechanism, one per
scheduler; an engine binding subclasses it to say what a request is (its job, its block
count, its job's first arrival) and how a pin's blocks go back to the engine's pool. Every pin's
blocks are returned exactly once, through ``free_blocks``.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_continuum.metrics import MetricSpec, value_of

# Why a pin ended (the ``reason`` of ``PinManager.on_released``).
PIN_RELEASE_HIT = "hit"  # the job's next turn took its prefix hit
PIN_RELEASE_EXPIRED = "expired"  # the TTL passed (and the job's turn was not next in line)
PIN_RELEASE_PRESSURE = "pressure"  # memory was needed by someone else
PIN_RELEASE_REPLACED = "replaced"  # the job pinned a newer request
PIN_RELEASE_SHUTDOWN = "shutdown"


@dataclass
class PinEntry:
    request: Any  # the engine's finished request; its blocks stay allocated under its id
    deadline: float
    pinned_at: float
    job_arrival: float  # first arrival of the job: a higher value means a newer job
    num_blocks: int
    strict: bool = False  # released under pressure only after every soft pin
    job: str = ""  # set by ``PinTable.add``
    seq: int = field(default=0)


@dataclass
class PinCounters:
    """Totals since start (an engine reports them as they are, or as deltas)."""

    pins: int = 0
    hits: int = 0  # a job's next turn found its pinned blocks
    expiries: int = 0  # the TTL ran out
    pressure_releases: int = 0  # released because memory was needed


class PinTable:
    """Pins by job, with deadline and pressure-order heaps (lazy deletion)."""

    def __init__(self) -> None:
        self._by_job: dict[str, PinEntry] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        # Pressure order: soft pins before strict ones, newest job first within each.
        self._pressure: list[tuple[bool, float, int, str]] = []  # (strict, -job_arrival, seq, job)
        self._seq = itertools.count()
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._by_job)

    def __contains__(self, job: object) -> bool:
        return job in self._by_job

    def get(self, job: str) -> PinEntry | None:
        return self._by_job.get(job)

    def add(self, job: str, entry: PinEntry) -> PinEntry | None:
        """Register a pin; returns the job's previous pin (the caller releases it)."""
        old = self.remove(job)
        entry.job, entry.seq = job, next(self._seq)
        self._by_job[job] = entry
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, job))
        heapq.heappush(self._pressure, (entry.strict, -entry.job_arrival, entry.seq, job))
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

    def pop_expired(self, now: float) -> Iterator[tuple[str, PinEntry]]:
        """Yield (job, entry) of pins whose deadline passed, oldest first; each leaves the
        deadline heap. The caller removes those it releases and ``rearm``s those it keeps
        (after the iteration), so a kept pin is examined again at the next step."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, job = heapq.heappop(self._deadlines)
            if self._live(seq, job):
                yield job, self._by_job[job]

    def rearm(self, job: str) -> None:
        """Put a kept expired pin back in the deadline heap (its deadline unchanged)."""
        entry = self._by_job[job]
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, job))

    def newest_job(self, exclude: str | None = None) -> str | None:
        """The pin released first under memory pressure: the newest job's soft pin, or
        the newest job's strict pin when no soft pin is left (never ``exclude``)."""
        skipped = []
        found = None
        while self._pressure:
            item = self._pressure[0]
            if not self._live(item[2], item[3]):
                heapq.heappop(self._pressure)
                continue
            if item[3] == exclude:
                skipped.append(heapq.heappop(self._pressure))
                continue
            found = item[3]
            break
        for item in skipped:
            heapq.heappush(self._pressure, item)
        return found

    def next_deadline(self) -> float | None:
        while self._deadlines and not self._live(self._deadlines[0][1], self._deadlines[0][2]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def jobs(self) -> list[str]:
        return list(self._by_job)

    def entries(self) -> Iterator[PinEntry]:
        return iter(self._by_job.values())

    def requests(self) -> Iterator[Any]:
        return (entry.request for entry in self._by_job.values())


class PinManager(ABC):
    """Places and ends pins for a scheduler; frees each pin's blocks exactly once.

    The engine's part, in a subclass: ``job_of``, ``num_blocks_of``, ``job_arrival_of`` (what
    a request is), ``free_blocks`` (how blocks go back), ``may_release`` (whether a
    requester may take a given pin under pressure), and the observers ``on_pinned`` /
    ``on_released`` (every pin change, e.g. to re-rank the waiting queue).
    """

    def __init__(self) -> None:
        self.pinned = PinTable()
        self.counters = PinCounters()

    def __len__(self) -> int:
        return len(self.pinned)

    def __contains__(self, job: object) -> bool:
        return job in self.pinned

    # -- the engine's part ----------------------------------------------------------------
    @abstractmethod
    def job_of(self, request: Any) -> str:
        """The request's job key."""

    @abstractmethod
    def num_blocks_of(self, request: Any) -> int:
        """KV blocks the (finished) request holds now."""

    @abstractmethod
    def job_arrival_of(self, request: Any) -> float:
        """First arrival of the request's job (a higher value is a newer job)."""

    @abstractmethod
    def free_blocks(self, entry: PinEntry, reason: str) -> None:
        """Return the pinned request's blocks to the pool (called once per pin)."""

    def may_release(self, requester: Any, entry: PinEntry, now: float) -> bool:
        """Whether ``requester`` (out of memory) may take another job's pin ``entry``."""
        return True

    def on_pinned(self, entry: PinEntry, now: float) -> None:
        """A pin was placed (its job now ranks as pinned)."""

    def on_released(self, entry: PinEntry, now: float, reason: str) -> None:
        """A pin ended, its blocks already freed (reason: ``PIN_RELEASE_*``)."""

    # -- the mechanism --------------------------------------------------------------------
    def pin(self, request: Any, ttl_s: float, now: float, strict: bool = False) -> PinEntry:
        """Keep the finished ``request``'s blocks until ``now + ttl_s`` at the latest; a
        ``strict`` pin goes under pressure only after every soft pin."""
        entry = PinEntry(
            request=request,
            deadline=now + ttl_s,
            pinned_at=now,
            job_arrival=self.job_arrival_of(request),
            num_blocks=self.num_blocks_of(request),
            strict=strict,
        )
        old = self.pinned.add(self.job_of(request), entry)
        self.counters.pins += 1
        self.on_pinned(entry, now)
        if old is not None:
            self._end(old, now, PIN_RELEASE_REPLACED)
        return entry

    def release(self, job: str, now: float, reason: str) -> bool:
        entry = self.pinned.remove(job)
        if entry is not None:
            self._end(entry, now, reason)
        return entry is not None

    def on_admitted(self, request: Any, num_hit: int, now: float) -> None:
        """The job's next turn was admitted: with its prefix hit it now holds the pinned
        blocks too, so the pin has done its job."""
        job = self.job_of(request)
        if job in self.pinned:
            if num_hit > 0:
                self.counters.hits += 1
            self.release(job, now, PIN_RELEASE_HIT)

    def expire(self, now: float, next_in_line: str | None) -> None:
        """End the pins whose deadline passed, except the pin of the job whose turn is
        first in line (it is about to take its hit). Holding a pin for a turn stuck
        behind others would deadlock memory, so any other expired pin goes. The kept pin
        is examined again at every step, so it ends as soon as its turn is no longer
        first in line (admitted: a hit; aborted: expired)."""
        for job, _ in list(self.pinned.pop_expired(now)):
            if job == next_in_line:
                self.pinned.rearm(job)
            else:
                self.release(job, now, PIN_RELEASE_EXPIRED)

    def release_for_pressure(self, requester: Any, now: float, exclude: str | None = None) -> bool:
        """Release the newest job's pin, soft pins before strict ones (not ``exclude``'s
        while another exists), for ``requester``, if ``may_release`` lets it take that
        pin (if it may not take the newest one, it may not take an older one either)."""
        job = self.pinned.newest_job(exclude=exclude)
        if job is None:
            job = self.pinned.newest_job()  # only the requester's own pin is left
        if job is None:
            return False
        entry = self.pinned.get(job)
        if job != self.job_of(requester) and not self.may_release(requester, entry, now):
            return False
        self.release(job, now, PIN_RELEASE_PRESSURE)
        return True

    def release_all(self, now: float) -> None:
        for job in self.pinned.jobs():
            self.release(job, now, PIN_RELEASE_SHUTDOWN)

    def next_deadline(self) -> float | None:
        return self.pinned.next_deadline()

    def _end(self, entry: PinEntry, now: float, reason: str) -> None:
        self.free_blocks(entry, reason)
        if reason == PIN_RELEASE_EXPIRED:
            self.counters.expiries += 1
        elif reason == PIN_RELEASE_PRESSURE:
            self.counters.pressure_releases += 1
        self.on_released(entry, now, reason)


def _pin_series(name: str, kind: str, doc: str, attr: str) -> MetricSpec:
    return MetricSpec(name, kind, doc, read=value_of(attr))  # type: ignore[arg-type]


# The pin series, declared once for every engine's exporter. Each reads an object with
# these attributes: our engine's ``PinStats`` (counters as deltas), the plugin's pin figures
# (counters as totals since start; its logger takes the deltas).
PIN_METRICS: tuple[MetricSpec, ...] = (
    _pin_series(
        "vllm:num_pinned_requests",
        "gauge",
        "Finished requests whose KV blocks are pinned for their job.",
        "num_pinned_requests",
    ),
    _pin_series("vllm:pinned_kv_blocks", "gauge", "KV blocks held by pins.", "pinned_kv_blocks"),
    _pin_series("vllm:pins", "counter", "KV pins placed.", "pins"),
    _pin_series(
        "vllm:pin_hits", "counter", "Next turns that found their pinned blocks.", "pin_hits"
    ),
    _pin_series("vllm:pin_expiries", "counter", "Pins released by TTL expiry.", "expiries"),
    _pin_series(
        "vllm:pin_forced_releases",
        "counter",
        "Pins released under memory pressure.",
        "forced_releases",
    ),
)
