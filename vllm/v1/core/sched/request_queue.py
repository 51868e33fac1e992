"""Waiting queues (vLLM's ``request_queue.py``): an ABC, small classes, a factory."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator

from vllm.v1.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    CONTINUUM = "continuum"
    CONTEXT_SERVE = "context_serve"


class RequestQueue(ABC):
    """Waiting requests in the order a policy admits them.

    Contract: ``peek_request``/``pop_request`` return the next request to admit;
    ``prepend_request`` puts back a request that could not be admitted this step (or a
    preempted one) so it is the next candidate again where the policy's order allows;
    ``remove_request`` removes an arbitrary request (abort). All operations are
    O(log n) or better, except ``remove_requests`` of many at once.
    """

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
