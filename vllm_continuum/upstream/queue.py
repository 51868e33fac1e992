"""The job-ordered waiting queue, as an upstream ``RequestQueue``.

Order: ``vllm_continuum.job_order.waiting_key`` (requests of pinned jobs first, then the
job's first arrival, then the request's arrival); a request that has waited longer than
``max_wait_s`` goes first regardless (pins and old jobs cannot starve anyone). Upstream's
``prepend_request`` (a preempted request going back) is an ordered insert: the key already
puts an old job's turn ahead. Heaps with lazy deletion: O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm_continuum.clock import Clock


class JobOrderRequestQueue(RequestQueue):
    def __init__(
        self,
        key: Callable[[Any], tuple],
        job_of: Callable[[Any], str],
        arrival_of: Callable[[Any], float],
        clock: Clock,
        max_wait_s: float,
    ) -> None:
        self._key, self._job_of, self._arrival_of = key, job_of, arrival_of
        self._clock = clock
        self._max_wait_s = max_wait_s
        self._heap: list[tuple] = []  # (*key, seq, request)
        self._by_age: list[tuple] = []  # (arrival, seq, request)
        self._live: dict[int, int] = {}  # id(request) -> seq of its live heap entry
        self._requests: dict[int, tuple[Any, str]] = {}  # id -> (request, its job)
        self._jobs: dict[str, set[int]] = defaultdict(set)
        self._seq = itertools.count()
        # Upstream pops the request it just peeked; admitting it may end its job's pin
        # (a hit) and re-rank the queue in between, so pop returns the peeked request.
        self._peeked: Any = None

    def _push(self, request: Any) -> None:
        seq = next(self._seq)
        heapq.heappush(self._heap, (*self._key(request), seq, request))
        self._live[id(request)] = seq

    def job_pin_changed(self, job: str) -> None:
        """Re-rank the job's waiting requests: it gained or lost a pin."""
        for rid in self._jobs.get(job, ()):
            self._push(self._requests[rid][0])  # the old entry goes stale

    def _prune(self) -> None:
        while self._heap and self._live.get(id(self._heap[0][-1])) != self._heap[0][-2]:
            heapq.heappop(self._heap)
        while self._by_age and id(self._by_age[0][2]) not in self._live:
            heapq.heappop(self._by_age)

    # -- RequestQueue ---------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        rid = id(request)
        if rid in self._live:
            return  # already queued (upstream re-queues skipped requests)
        job = self._job_of(request)
        self._requests[rid] = (request, job)
        self._jobs[job].add(rid)
        self._push(request)
        heapq.heappush(self._by_age, (self._arrival_of(request), self._live[rid], request))

    def prepend_request(self, request: Any) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            self.add_request(request)

    def peek_request(self) -> Any:
        self._prune()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        oldest = self._by_age[0][2]
        if self._clock() - self._arrival_of(oldest) > self._max_wait_s:
            self._peeked = oldest  # bounded waiting beats job order
        else:
            self._peeked = self._heap[0][-1]
        return self._peeked

    def pop_request(self) -> Any:
        peeked = self._peeked
        request = peeked if peeked is not None and id(peeked) in self._live else None
        request = request if request is not None else self.peek_request()
        self.remove_request(request)
        return request

    def remove_request(self, request: Any) -> None:
        rid = id(request)
        if self._live.pop(rid, None) is None:
            raise ValueError(f"{request.request_id} is not waiting")
        if request is self._peeked:
            self._peeked = None
        _, job = self._requests.pop(rid)
        self._jobs[job].discard(rid)
        if not self._jobs[job]:
            del self._jobs[job]

    def remove_requests(self, requests: Iterable[Any]) -> None:
        for request in requests:
            if id(request) in self._live:
                self.remove_request(request)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Any]:
        live = [e for e in self._heap if self._live.get(id(e[-1])) == e[-2]]
        return iter(e[-1] for e in sorted(live, key=lambda e: e[:-1]))
