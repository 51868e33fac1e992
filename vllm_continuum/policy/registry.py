"""The one map from a scheduling policy's name to its class, for every engine.

Our ``--scheduling-policy`` choices and config validation, the upstream plugin's choices,
``create_policy`` and each engine's metrics exporter all read it, so a name without an
implementation cannot exist. Classes are imported on first use (``module:Class``), so
plain policies need no predictor dependencies. A new policy is its module and one line
here (or a ``register_policy`` call from a plugin).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from vllm_continuum.clock import Clock, monotonic_clock

if TYPE_CHECKING:
    from vllm_continuum.metrics import MetricSpec
    from vllm_continuum.policy.base import Policy, PolicySettings

_REGISTRY: dict[str, str] = {
    "fcfs": "vllm_continuum.policy.plain:FCFSPolicy",
    "priority": "vllm_continuum.policy.plain:PriorityPolicy",
    "continuum": "vllm_continuum.policy.continuum:ContinuumPolicy",
    "context_serve": "vllm_continuum.policy.context_serve:ContextServePolicy",
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


def unregister_policy(name: str) -> None:
    """Remove ``name`` (tests that register a policy of their own undo it)."""
    _REGISTRY.pop(name, None)


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


def create_policy(
    name: str,
    settings: PolicySettings | None = None,
    decode: Callable[[Sequence[int]], str | None] | None = None,
    clock: Clock = monotonic_clock,
    has_kv_tier: bool = False,
) -> Policy:
    """Build the policy registered as ``name``: the one place policies are built, in
    every engine. ``decode`` (token ids -> text) is required by policies that read
    outputs; ``has_kv_tier``: whether the engine has a CPU KV tier (the engine knows)."""
    from vllm_continuum.policy.base import PolicySettings

    cls = get_policy_class(name)
    if cls.needs_decode and decode is None:
        raise ValueError(f"scheduling_policy {name!r} reads outputs: pass decode")
    return cls.from_settings(settings or PolicySettings(), decode, clock, has_kv_tier)
