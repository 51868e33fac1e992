"""Waiting queues (vLLM's ``request_queue.py``): an ABC and small classes.

A policy names its order (``Policy.queue_order``); ``policy.make_request_queue`` maps it
to one of these or to the job order (``job_queue.py``)."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from vllm.v1.request import Request


class RequestQueue(ABC):
    """Waiting requests in the order a policy admits them.

    Contract: ``peek_request``/``pop_request`` return the next request to admit;
    ``prepend_request`` puts back a request that could not be admitted this step (or a
    preempted one) so it is the next candidate again where the policy's order allows;
    ``remove_request`` removes an arbitrary request (abort); ``job_pin_changed`` tells a
    queue whose order depends on pins that a job gained or lost one. All operations are
    O(log n) or better, except ``remove_requests`` of many at once.
    """

    def job_pin_changed(self, job: str) -> None:  # noqa: B027 - optional hook
        """A job gained or lost a pin (plain queues ignore pins)."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None: ...

    @abstractmethod
    def prepend_requests(self, requests: RequestQueue) -> None: ...

    @abstractmethod
    def remove_request(self, request: Request) -> None: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __bool__(self) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue(RequestQueue):
    """First come, first served (a deque; prepend puts a request at the front)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        self._queue.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class KeyOrderedRequestQueue(RequestQueue):
    """A queue whose order comes from each request's own key: putting a request back
    (after preemption, or when it could not be admitted) is adding it again."""

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: RequestQueue) -> None:
        for request in requests:
            self.add_request(request)


class PriorityRequestQueue(KeyOrderedRequestQueue):
    """Lowest (priority, arrival_time) first; a heap with lazy deletion."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[int, Request] = {}  # id(request) -> request
        self._seq = itertools.count()

    def _prune(self) -> None:
        while self._heap and id(self._heap[0][3]) not in self._live:
            heapq.heappop(self._heap)

    def add_request(self, request: Request) -> None:
        self._live[id(request)] = request
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._seq), request)
        )

    def pop_request(self) -> Request:
        self._prune()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        request = heapq.heappop(self._heap)[3]
        del self._live[id(request)]
        return request

    def peek_request(self) -> Request:
        self._prune()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][3]

    def remove_request(self, request: Request) -> None:
        if self._live.pop(id(request), None) is None:
            raise ValueError(f"{request.request_id} is not waiting")

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self._live.pop(id(request), None)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._live.values(), key=lambda r: (r.priority, r.arrival_time)))
