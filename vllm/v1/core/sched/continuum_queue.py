"""Job-level FCFS waiting queue for Continuum, with bounded waiting.

Order: ``vllm_continuum.job_order.waiting_key``: requests of jobs that hold pinned blocks
first, then by the job's *first* arrival (turn 5 of an old job beats turn 1 of a new one),
then by request arrival. Which jobs are pinned is read from the scheduler's pins (a live
view); ``job_pin_changed`` re-ranks a job's requests when that changes. A request that
has waited longer than its bound (``wait_bound(request)`` seconds: ``max_wait_s``, or the
job-admission bound for a new job's first turn) is served first regardless, so pins and
old jobs cannot starve anyone. Heaps with lazy deletion: O(log n) operations.
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Container, Iterable, Iterator

from vllm.utils.clock import Clock
from vllm.v1.core.sched.request_queue import KeyOrderedRequestQueue
from vllm.v1.request import Request
from vllm_continuum.job_order import waiting_key


class ContinuumRequestQueue(KeyOrderedRequestQueue):
    def __init__(
        self,
        job_arrival: Callable[[Request], float],
        clock: Clock,
        wait_bound: Callable[[Request], float],
        pinned_jobs: Container[str] = frozenset(),
    ) -> None:
        self._job_arrival = job_arrival
        self._clock = clock
        self._wait_bound = wait_bound
        self._pinned_jobs = pinned_jobs
        self._heap: list[tuple] = []  # (not pinned, job arrival, arrival, seq, request)
        self._by_age: list[tuple] = []  # (arrival + wait bound, seq, request)
        self._live: dict[int, int] = {}  # id(request) -> seq of its live heap entry
        self._jobs: dict[str, set[int]] = defaultdict(set)  # job -> ids of its requests
        self._requests: dict[int, Request] = {}
        self._seq = itertools.count()

    # -- keys -----------------------------------------------------------------------------
    def _push(self, request: Request) -> None:
        seq = next(self._seq)
        key = waiting_key(
            request.job_key in self._pinned_jobs, self._job_arrival(request), request.arrival_time
        )
        heapq.heappush(self._heap, (*key, seq, request))
        self._live[id(request)] = seq

    def job_pin_changed(self, job: str) -> None:
        """Re-rank the job's waiting requests: it gained or lost a pin."""
        for rid in self._jobs.get(job, ()):
            self._push(self._requests[rid])  # the old entry goes stale

    # -- RequestQueue ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        rid = id(request)
        self._requests[rid] = request
        self._jobs[request.job_key].add(rid)
        self._push(request)
        starve_at = request.arrival_time + self._wait_bound(request)
        heapq.heappush(self._by_age, (starve_at, self._live[rid], request))

    def _prune(self) -> None:
        while self._heap and self._live.get(id(self._heap[0][4])) != self._heap[0][3]:
            heapq.heappop(self._heap)
        while self._by_age and id(self._by_age[0][2]) not in self._live:
            heapq.heappop(self._by_age)

    def peek_request(self) -> Request:
        self._prune()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        starve_at, _, oldest = self._by_age[0]
        if self._clock() > starve_at:
            return oldest  # bounded waiting beats job order
        return self._heap[0][4]

    def pop_request(self) -> Request:
        request = self.peek_request()
        self.remove_request(request)
        return request

    def remove_request(self, request: Request) -> None:
        rid = id(request)
        if self._live.pop(rid, None) is None:
            raise ValueError(f"{request.request_id} is not waiting")
        del self._requests[rid]
        job = request.job_key
        self._jobs[job].discard(rid)
        if not self._jobs[job]:
            del self._jobs[job]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            if id(request) in self._live:
                self.remove_request(request)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        live = [e for e in self._heap if self._live.get(id(e[4])) == e[3]]
        return iter(e[4] for e in sorted(live, key=lambda e: e[:4]))
