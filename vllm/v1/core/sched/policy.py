"""This engine's side of the policy seam: building the configured policy and its queue.

The policies themselves (and the seam, ``Policy``) live once for every engine in
``vllm_continuum.policy``; this module maps our ``VllmConfig`` to their settings and a
policy's ``queue_order`` to our ``RequestQueue``. It names no policy.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from vllm.config import VllmConfig
from vllm.utils.clock import Clock, monotonic_clock
from vllm.v1.core.sched.job_queue import JobRequestQueue
from vllm.v1.core.sched.request_queue import FCFSRequestQueue, PriorityRequestQueue, RequestQueue
from vllm_continuum.policy import Policy, PolicySettings
from vllm_continuum.policy import create_policy as _create_policy

__all__ = ["create_policy", "make_request_queue", "policy_settings"]


def policy_settings(vllm_config: VllmConfig) -> PolicySettings:
    """The policy settings our config carries (``RUN_OUTPUT_DIR`` for event logs)."""
    return PolicySettings.from_env(vllm_config.policy_config, vllm_config.context_serve_config)


def create_policy(
    vllm_config: VllmConfig,
    decode: Callable[[Sequence[int]], str | None] | None = None,
    clock: Clock = monotonic_clock,
    has_kv_tier: bool = False,
) -> Policy:
    """Build the configured policy (``scheduler_config.policy``) with ``vllm_continuum``'s
    ``create_policy``; ``has_kv_tier``: whether the engine has a CPU KV tier."""
    return _create_policy(
        vllm_config.scheduler_config.policy,
        policy_settings(vllm_config),
        decode=decode,
        clock=clock,
        has_kv_tier=has_kv_tier,
    )


def make_request_queue(policy: Policy, clock: Clock, pinned_jobs: Container[str]) -> RequestQueue:
    """The waiting queue of ``policy.queue_order`` (``pinned_jobs``: the scheduler's live
    view of the jobs holding pins, read by the job order)."""
    if policy.queue_order == "fcfs":
        return FCFSRequestQueue()
    if policy.queue_order == "priority":
        return PriorityRequestQueue()
    if policy.queue_order == "job":
        return JobRequestQueue(policy.job_arrival, clock, policy.wait_bound, pinned_jobs)
    raise ValueError(f"policy {policy.name!r}: unknown queue_order {policy.queue_order!r}")
