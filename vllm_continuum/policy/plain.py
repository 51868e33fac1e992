"""vLLM's own policies: first come first served, and priority."""

from __future__ import annotations

from typing import Any

from vllm_continuum.policy.base import Policy, RequestView


class FCFSPolicy(Policy):
    """Admit in arrival order; preempt the last admitted; free finished blocks at once."""

    name = "fcfs"


class PriorityPolicy(Policy):
    """Lower ``priority`` value first, ties by arrival; the worst one is preempted."""

    name = "priority"
    queue_order = "priority"

    def victim_key(self, request: RequestView) -> Any:
        return (request.priority, request.arrival_time)
