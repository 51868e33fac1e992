"""Scheduling policies behind one interface (see ``base.Policy``) and their factory."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from vllm.config import SCHEDULING_POLICIES, PolicyConfig
from vllm.utils.clock import Clock, monotonic_clock
from vllm.v1.core.sched.policy.base import FREE, FinishedAction, Free, Offload, Pin, Policy

__all__ = ["FREE", "Free", "FinishedAction", "Offload", "Pin", "Policy", "create_policy"]

# name -> (module, class); imported lazily so plain policies need no predictor deps.
_POLICIES = {
    "fcfs": ("vllm.v1.core.sched.policy.fcfs", "FCFSPolicy"),
    "priority": ("vllm.v1.core.sched.policy.priority", "PriorityPolicy"),
    "continuum": ("vllm.v1.core.sched.policy.continuum", "ContinuumPolicy"),
    "context_serve": ("vllm.v1.core.sched.policy.context_serve", "ContextServePolicy"),
}


def create_policy(
    name: str,
    config: PolicyConfig | None = None,
    decode: Callable[[list[int]], str] | None = None,
    clock: Clock = monotonic_clock,
) -> Policy:
    """Build the policy called ``name`` (one of ``SCHEDULING_POLICIES``)."""
    if name not in _POLICIES:
        raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {name!r}")
    module_name, class_name = _POLICIES[name]
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scheduling_policy {name!r} is not available: {e}") from e
    if name in ("fcfs", "priority"):
        return cls(config, decode=decode)
    return cls(config, decode=decode, clock=clock)
