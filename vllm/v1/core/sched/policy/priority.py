"""Priority scheduling: lower ``priority`` value first, ties by arrival."""

from __future__ import annotations

from collections.abc import Container, Sequence

from vllm.v1.core.sched.policy.base import Policy
from vllm.v1.core.sched.request_queue import PriorityRequestQueue, RequestQueue
from vllm.v1.request import Request


class PriorityPolicy(Policy):
    name = "priority"

    def create_request_queue(self, pinned_jobs: Container[str]) -> RequestQueue:
        return PriorityRequestQueue()

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The worst (priority, arrival_time) running request."""
        return max(running, key=lambda r: (r.priority, r.arrival_time))
