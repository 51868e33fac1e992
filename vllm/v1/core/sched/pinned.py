"""The pin mechanism: finished requests whose KV blocks a policy asked to keep.

A pinned request keeps its blocks referenced in the KV cache manager until its pin
ends: its job's next turn takes the prefix hit, the TTL passes, memory is needed by
someone else, the job pins a newer turn, or the engine shuts down. One pin per job.
A pin that ends by TTL or pressure is offloaded to the CPU KV tier (when there is one).
``PinnedRequests`` is the bookkeeping (O(1) lookups by job; heaps with lazy deletion for
expiry and pressure release, so a step never scans all pins); ``PinManager`` is the
mechanism the scheduler calls, and the one owner of "which jobs are pinned".
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.policy.base import (
    PIN_RELEASE_EXPIRED,
    PIN_RELEASE_HIT,
    PIN_RELEASE_PRESSURE,
    PIN_RELEASE_REPLACED,
    PIN_RELEASE_SHUTDOWN,
    Policy,
)
from vllm.v1.metrics.stats import PinStats
from vllm.v1.request import Request


@dataclass
class PinEntry:
    request: Request
    deadline: float
    pinned_at: float
    job_age: float  # first arrival of the job: a higher value means a newer job
    num_blocks: int
    strict: bool = False  # released under pressure only after every soft pin
    seq: int = field(default=0)


class PinnedRequests:
    """Pins by job, with deadline and pressure-order heaps (lazy deletion)."""

    def __init__(self) -> None:
        self._by_job: dict[str, PinEntry] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        # Pressure order: soft pins before strict ones, newest job first within each.
        self._newest_job: list[tuple[bool, float, int, str]] = []  # (strict, -age, seq, job)
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
        entry.seq = next(self._seq)
        self._by_job[job] = entry
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, job))
        heapq.heappush(self._newest_job, (entry.strict, -entry.job_age, entry.seq, job))
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
        the newest job's strict pin when no soft pin is left."""
        skipped = []
        found = None
        while self._newest_job:
            item = self._newest_job[0]
            if not self._live(item[2], item[3]):
                heapq.heappop(self._newest_job)
                continue
            if item[3] == exclude:
                skipped.append(heapq.heappop(self._newest_job))
                continue
            found = item[3]
            break
        for item in skipped:
            heapq.heappush(self._newest_job, item)
        return found

    def next_deadline(self) -> float | None:
        while self._deadlines and not self._live(self._deadlines[0][1], self._deadlines[0][2]):
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def jobs(self) -> list[str]:
        return list(self._by_job)

    def requests(self) -> Iterator[Request]:
        return (entry.request for entry in self._by_job.values())


class PinManager:
    """Places and ends pins for the scheduler; frees a pin's blocks exactly once.

    Every pin change is reported to the policy (``on_pinned`` / ``on_pin_released``), and
    counted in ``stats`` (drained by the scheduler's ``make_stats``).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, policy: Policy) -> None:
        self.kv = kv_cache_manager
        self.policy = policy
        self.pinned = PinnedRequests()
        self.stats = PinStats()

    def __len__(self) -> int:
        return len(self.pinned)

    def __contains__(self, job: object) -> bool:
        return job in self.pinned

    def pin(self, request: Request, ttl_s: float, now: float, strict: bool = False) -> None:
        """Keep the finished ``request``'s blocks until ``now + ttl_s`` at the latest
        (``strict``: see ``Pin``)."""
        entry = PinEntry(
            request=request,
            deadline=now + ttl_s,
            pinned_at=now,
            job_age=self.policy.job_arrival(request),
            num_blocks=self.kv.get_num_blocks(request.request_id),
            strict=strict,
        )
        old = self.pinned.add(request.job_key, entry)
        self.stats.pins += 1
        self.policy.on_pinned(request, now)
        if old is not None:
            self._free(old, now, PIN_RELEASE_REPLACED)

    def release(self, job: str, now: float, reason: str) -> None:
        entry = self.pinned.remove(job)
        if entry is not None:
            self._free(entry, now, reason)

    def on_admitted(self, request: Request, num_hit: int, now: float) -> None:
        """The job's next turn was admitted: with its prefix hit it now holds the pinned
        blocks too, so the pin has done its job."""
        job = request.job_key
        if job in self.pinned:
            if num_hit > 0:
                self.stats.pin_hits += 1
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

    def release_for_pressure(
        self, requester: Request, now: float, exclude: str | None = None
    ) -> bool:
        """Release the newest job's pin, soft pins before strict ones (not ``exclude``'s
        while another exists), for ``requester``, if the policy lets it take that job's
        pin (if it may not take the newest one, it may not take an older one either)."""
        job = self.pinned.newest_job(exclude=exclude)
        if job is None:
            job = self.pinned.newest_job()  # only the requester's own pin is left
        if job is None:
            return False
        if job != requester.job_key and not self.policy.may_release_pin(
            requester, self.pinned.get(job).job_age, now
        ):
            return False
        self.release(job, now, PIN_RELEASE_PRESSURE)
        return True

    def release_all(self, now: float) -> None:
        for job in self.pinned.jobs():
            self.release(job, now, PIN_RELEASE_SHUTDOWN)

    def next_deadline(self) -> float | None:
        return self.pinned.next_deadline()

    def _free(self, entry: PinEntry, now: float, reason: str) -> None:
        # A pin that ends without its hit (TTL, pressure) still names a context the job is
        # likely to resume: with a CPU KV tier it is offloaded rather than dropped.
        offload = reason in (PIN_RELEASE_EXPIRED, PIN_RELEASE_PRESSURE)
        self.kv.free(entry.request, offload=offload)
        if reason == PIN_RELEASE_EXPIRED:
            self.stats.expiries += 1
        elif reason == PIN_RELEASE_PRESSURE:
            self.stats.forced_releases += 1
        self.policy.on_pin_released(entry.request, now, reason)
