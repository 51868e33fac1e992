"""Scheduling policies, once for every engine: the seam (``base``), the registry, and the
policies (``plain``: fcfs and priority; ``continuum``; ``context_serve``)."""

from vllm_continuum.policy.base import (
    FREE,
    FinishedAction,
    Free,
    Offload,
    Pin,
    Policy,
    PolicySettings,
    RequestView,
)
from vllm_continuum.policy.registry import (
    create_policy,
    get_policy_class,
    policy_metrics,
    policy_names,
    register_policy,
)

__all__ = [
    "FREE",
    "FinishedAction",
    "Free",
    "Offload",
    "Pin",
    "Policy",
    "PolicySettings",
    "RequestView",
    "create_policy",
    "get_policy_class",
    "policy_metrics",
    "policy_names",
    "register_policy",
]
