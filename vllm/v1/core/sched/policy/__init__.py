"""Scheduling policies behind one interface (see ``base.Policy``) and their factory."""

from __future__ import annotations

from collections.abc import Callable

from vllm.config import VllmConfig
from vllm.utils.clock import Clock, monotonic_clock
from vllm.v1.core.sched.policy.base import FREE, FinishedAction, Free, Offload, Pin, Policy
from vllm.v1.core.sched.policy.registry import get_policy_class, policy_names

__all__ = [
    "FREE",
    "Free",
    "FinishedAction",
    "Offload",
    "Pin",
    "Policy",
    "create_policy",
    "policy_names",
]


def create_policy(
    vllm_config: VllmConfig,
    decode: Callable[[list[int]], str] | None = None,
    clock: Clock = monotonic_clock,
    has_kv_tier: bool = False,
) -> Policy:
    """Build the configured policy (``scheduler_config.policy``): the one place policies
    are built. ``decode`` (token ids -> text) is required by policies that read outputs;
    ``has_kv_tier``: whether the engine has a CPU KV tier (the engine core knows)."""
    cls = get_policy_class(vllm_config.scheduler_config.policy)
    if cls.needs_decode and decode is None:
        raise ValueError(f"scheduling_policy {cls.name!r} reads outputs: pass decode")
    return cls.from_config(vllm_config, decode, clock, has_kv_tier)
