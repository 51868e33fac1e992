"""The job-ordered waiting queue of Continuum, with bounded waiting, engine-agnostic.

Order: ``job_order.waiting_key``: requests of jobs that hold pinned blocks first, then by
the job's *first* arrival (turn 5 of an old job beats turn 1 of a new one), then by
request arrival. Which jobs are pinned is read from a live view (``pinned_jobs``);
``job_pin_changed`` re-ranks a job's requests when that changes. A request that has waited
longer than its bound (``wait_bound(request)`` seconds: ``max_wait_s``, or the
job-admission bound for a new job's first turn) is served first regardless, so pins and
old jobs cannot starve anyone. Putting a request back (preempted, or not admitted this
step) is adding it again: its key already says where it goes. Heaps with lazy deletion:
O(log n) operations.

An engine binding supplies what a request is (``job_of``, ``arrival_of``,
``job_arrival``) and mixes in its own ``RequestQueue`` interface; the method names are
vLLM's.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

from vllm_continuum.clock import Clock
from vllm_continuum.job_order import waiting_key


class JobOrderQueue:
    def __init__(
        self,
        job_of: Callable[[Any], str],
        arrival_of: Callable[[Any], float],
        job_arrival: Callable[[Any], float],
        clock: Clock,
        wait_bound: Callable[[Any], float],
        pinned_jobs: Container[str] = frozenset(),
    ) -> None:
        self._job_of, self._arrival_of, self._job_arrival = job_of, arrival_of, job_arrival
        self._clock = clock
        self._wait_bound = wait_bound
        self._pinned_jobs = pinned_jobs
        self._heap: list[tuple] = []  # (not pinned, job arrival, arrival, seq, request)
        self._by_age: list[tuple] = []  # (arrival + wait bound, seq, request)
        self._live: dict[int, int] = {}  # id(request) -> seq of its live heap entry
        self._requests: dict[int, tuple[Any, str]] = {}  # id -> (request, its job)
        self._jobs: dict[str, set[int]] = defaultdict(set)  # job -> ids of its requests
        self._seq = itertools.count()

    # -- keys -----------------------------------------------------------------------------
    def _push(self, request: Any, job: str) -> None:
        seq = next(self._seq)
        key = waiting_key(
            job in self._pinned_jobs, self._job_arrival(request), self._arrival_of(request)
        )
        heapq.heappush(self._heap, (*key, seq, request))
        self._live[id(request)] = seq

    def job_pin_changed(self, job: str) -> None:
        """Re-rank the job's waiting requests: it gained or lost a pin."""
        for rid in self._jobs.get(job, ()):
            self._push(*self._requests[rid])  # the old entry goes stale

    def _prune(self) -> None:
        while self._heap and self._live.get(id(self._heap[0][-1])) != self._heap[0][-2]:
            heapq.heappop(self._heap)
        while self._by_age and id(self._by_age[0][2]) not in self._live:
            heapq.heappop(self._by_age)

    # -- the queue ------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        """Queue ``request`` (a request already queued stays where it is)."""
        rid = id(request)
        if rid in self._live:
            return
        job = self._job_of(request)
        self._requests[rid] = (request, job)
        self._jobs[job].add(rid)
        self._push(request, job)
        starve_at = self._arrival_of(request) + self._wait_bound(request)
        heapq.heappush(self._by_age, (starve_at, self._live[rid], request))

    def prepend_request(self, request: Any) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Any]) -> None:
        for request in list(requests):
            self.add_request(request)

    def peek_request(self) -> Any:
        self._prune()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        starve_at, _, oldest = self._by_age[0]
        if self._clock() > starve_at:
            return oldest  # bounded waiting beats job order
        return self._heap[0][-1]

    def pop_request(self) -> Any:
        request = self.peek_request()
        self.remove_request(request)
        return request

    def remove_request(self, request: Any) -> None:
        rid = id(request)
        if self._live.pop(rid, None) is None:
            raise ValueError(f"{request.request_id} is not waiting")
        _, job = self._requests.pop(rid)
        self._jobs[job].discard(rid)
        if not self._jobs[job]:
            del self._jobs[job]

    def remove_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            if id(request) in self._live:
                self.remove_request(request)

    def __contains__(self, request: object) -> bool:
        return id(request) in self._live

    def __bool__(self) -> bool:
        return bool(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Any]:
        live = [e for e in self._heap if self._live.get(id(e[-1])) == e[-2]]
        return iter(e[-1] for e in sorted(live, key=lambda e: e[:-1]))
