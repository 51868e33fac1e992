"""Bookkeeping of pinned finished requests (the Continuum mechanism).

A pinned request keeps its KV blocks referenced in the KV cache manager until its pin
ends. One pin per job. Lookups by job are O(1); expiry and pressure release use heaps
with lazy deletion, so a step never scans all pins.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from vllm.v1.request import Request


def job_key(request: Request) -> str:
    """Requests without job_id are their own job."""
    return request.job_id if request.job_id is not None else f"request:{request.request_id}"


@dataclass
class PinEntry:
    request: Request
    deadline: float
    pinned_at: float
    job_age: float  # first arrival of the job: a higher value means a newer job
    num_blocks: int
    seq: int = field(default=0)


class PinnedRequests:
    def __init__(self) -> None:
        self._by_job: dict[str, PinEntry] = {}
        self._deadlines: list[tuple[float, int, str]] = []
        self._newest_job: list[tuple[float, int, str]] = []  # (-job_age, seq, job)
        self._seq = itertools.count()
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._by_job)

    def __contains__(self, job: str) -> bool:
        return job in self._by_job

    def get(self, job: str) -> PinEntry | None:
        return self._by_job.get(job)

    def add(self, job: str, entry: PinEntry) -> PinEntry | None:
        """Register a pin; returns the job's previous pin (the caller releases it)."""
        old = self.remove(job)
        entry.seq = next(self._seq)
        self._by_job[job] = entry
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, job))
        heapq.heappush(self._newest_job, (-entry.job_age, entry.seq, job))
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
        """Yield (job, entry) of pins whose deadline passed, oldest first; the caller
        removes those it releases. Each pin is yielded once (it leaves the deadline heap),
        so one kept because its job has a waiting request is not re-examined each step."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, job = heapq.heappop(self._deadlines)
            if self._live(seq, job):
                yield job, self._by_job[job]

    def newest_job(self, exclude: str | None = None) -> str | None:
        """The pinned job that arrived last (released first under memory pressure)."""
        skipped = []
        found = None
        while self._newest_job:
            item = self._newest_job[0]
            if not self._live(item[1], item[2]):
                heapq.heappop(self._newest_job)
                continue
            if item[2] == exclude:
                skipped.append(heapq.heappop(self._newest_job))
                continue
            found = item[2]
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
