"""The one map from a scheduling policy's name to its class.

``--scheduling-policy``'s choices, ``SchedulerConfig``'s validation, ``create_policy`` and
the Prometheus logger (each policy's declared metrics) all read it, so a name without an
implementation cannot exist. Classes are imported on first use (``module:Class``), so
plain policies need no predictor dependencies. This module imports nothing from the
engine, so ``vllm.config`` can use it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.sched.policy.base import Policy
    from vllm_continuum.metrics import MetricSpec

_REGISTRY: dict[str, str] = {
    "fcfs": "vllm.v1.core.sched.policy.fcfs:FCFSPolicy",
    "priority": "vllm.v1.core.sched.policy.priority:PriorityPolicy",
    "continuum": "vllm.v1.core.sched.policy.continuum:ContinuumPolicy",
    "context_serve": "vllm.v1.core.sched.policy.context_serve:ContextServePolicy",
}


def policy_names() -> tuple[str, ...]:
    """The registered names, in registration order (``fcfs`` first: the default)."""
    return tuple(_REGISTRY)


def register_policy(name: str, target: str) -> None:
    """Register ``module:Class`` under ``name`` (an extension point for plugins)."""
    if not name or ":" not in target:
        raise ValueError(
            f"register_policy needs a name and 'module:Class', got {name!r}, {target!r}"
        )
    if name in _REGISTRY and _REGISTRY[name] != target:
        raise ValueError(f"scheduling policy {name!r} is already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = target


def get_policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``; ValueError naming scheduling_policy otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"scheduling_policy must be one of {policy_names()}, got {name!r}")
    module_name, class_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def policy_metrics() -> dict[str, tuple[MetricSpec, ...]]:
    """Each registered policy's declared metrics (``Policy.metrics()``), by name: what an
    exporter that does not know the configured policy creates (the front end's)."""
    return {name: get_policy_class(name).metrics() for name in policy_names()}
