"""First come, first served (vLLM's default)."""

from __future__ import annotations

from collections.abc import Container

from vllm.v1.core.sched.policy.base import Policy
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, RequestQueue


class FCFSPolicy(Policy):
    """Admit in arrival order; preempt the last admitted; free finished blocks at once."""

    name = "fcfs"

    def create_request_queue(self, pinned_jobs: Container[str]) -> RequestQueue:
        return FCFSRequestQueue()
