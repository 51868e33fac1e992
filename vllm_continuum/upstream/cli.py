"""The general plugin: our policies as values of upstream's ``--scheduling-policy``.

Upstream loads ``vllm.general_plugins`` in every process, and in the front end before it
builds the CLI parser (``AsyncEngineArgs.add_cli_args``), so that a plugin can extend the
parser. Upstream's ``SchedulerConfig.policy`` is a closed ``Literal["fcfs", "priority"]``,
so a policy of ours is not passed to it: ``EngineArgs.create_engine_config`` maps
``--scheduling-policy continuum`` to ``--scheduler-cls <our class>`` (on upstream's FCFS
base: our class replaces the queue and the victim itself) before upstream validates
anything. ``LLM(..., scheduling_policy="continuum")`` goes through the same mapping.
Patching is idempotent: the plugin may be loaded many times per process.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Upstream's own --scheduling-policy values: served by upstream's scheduler, not ours.
UPSTREAM_POLICIES = ("fcfs", "priority")
SCHEDULER = "vllm_continuum.upstream.scheduler.PolicyScheduler"
# Each class's async-scheduling variant, used when upstream turns async scheduling on.
ASYNC_VARIANTS: dict[str, str] = {
    SCHEDULER: "vllm_continuum.upstream.scheduler.AsyncPolicyScheduler",
    "vllm_continuum.upstream.scheduler.ContinuumScheduler": (
        "vllm_continuum.upstream.scheduler.AsyncContinuumScheduler"
    ),
    "vllm_continuum.upstream.context_serve.ContextServeScheduler": (
        "vllm_continuum.upstream.context_serve.AsyncContextServeScheduler"
    ),
}


def our_policies() -> tuple[str, ...]:
    """The registry's policies that upstream does not have (a new policy registered in
    ``vllm_continuum.policy.registry`` is offered here with no other change)."""
    from vllm_continuum.policy.registry import policy_names

    return tuple(name for name in policy_names() if name not in UPSTREAM_POLICIES)


_PATCHED = "_vllm_continuum_patched"


def install() -> None:
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:  # not upstream vLLM: nothing to extend
        return
    if getattr(EngineArgs, _PATCHED, False):
        return
    if not hasattr(EngineArgs, "add_cli_args") or not hasattr(EngineArgs, "create_engine_config"):
        logger.error(
            "vllm-continuum-plugin: this vLLM has no EngineArgs.add_cli_args/"
            "create_engine_config; use --scheduler-cls %s",
            SCHEDULER,
        )
        return
    EngineArgs.add_cli_args = staticmethod(_with_our_choices(EngineArgs.add_cli_args))
    EngineArgs.create_engine_config = _mapping_our_policies(EngineArgs.create_engine_config)
    setattr(EngineArgs, _PATCHED, True)


def _with_our_choices(add_cli_args: Any) -> Any:
    @functools.wraps(add_cli_args)
    def add_cli_args_with_our_policies(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = add_cli_args(parser, *args, **kwargs)
        for action in getattr(parser, "_actions", ()):
            if "--scheduling-policy" in action.option_strings and action.choices is not None:
                extra = [p for p in our_policies() if p not in action.choices]
                action.choices = [*action.choices, *extra]
                action.help = (action.help or "") + (
                    "\n- " + ", ".join(f'"{p}"' for p in extra) + ": agent-aware policies "
                    "of vllm-continuum-plugin (settings: --additional-config "
                    '\'{"continuum": {...}, "context_serve": {...}}\').'
                )
        return parser

    return add_cli_args_with_our_policies


def _mapping_our_policies(create_engine_config: Any) -> Any:
    @functools.wraps(create_engine_config)
    def create_engine_config_with_our_policies(self: Any, *args: Any, **kwargs: Any) -> Any:
        apply_policy(self)
        config = create_engine_config(self, *args, **kwargs)
        use_async_variant(config.scheduler_config)
        return config

    return create_engine_config_with_our_policies


def apply_policy(engine_args: Any) -> None:
    """Turn ``scheduling_policy=<ours>`` into upstream settings, on ``engine_args``: our
    scheduler class, the policy's name and settings, and its host KV tier (``tier.py``)."""
    name = engine_args.scheduling_policy
    if name not in our_policies():
        return
    from vllm_continuum.upstream.compat import check_policy_dependencies, check_upstream
    from vllm_continuum.upstream.settings import (
        SECTION,
        context_serve_config_from,
        policy_config_from,
    )
    from vllm_continuum.upstream.tier import configure_tier

    check_upstream()  # a clear error now, in the front end, not in the engine process
    check_policy_dependencies(name)
    if engine_args.scheduler_cls not in (None, SCHEDULER):
        raise ValueError(
            f"--scheduling-policy {name} selects its own scheduler class; "
            f"drop --scheduler-cls {engine_args.scheduler_cls}"
        )
    additional = dict(engine_args.additional_config or {})
    policy_config_from(additional)  # validate the settings before any process starts
    context_serve_config_from(additional)
    section = dict(additional.get(SECTION) or {})
    section["policy"] = name  # PolicyScheduler builds the policy of this name
    additional[SECTION] = section
    engine_args.additional_config = additional
    configure_tier(engine_args, name)
    engine_args.scheduler_cls = SCHEDULER
    engine_args.scheduling_policy = "fcfs"
    logger.info("scheduling policy %s: scheduler class %s", name, SCHEDULER)


def use_async_variant(scheduler_config: Any) -> None:
    """Once upstream has decided async scheduling (``VllmConfig`` resolves a None), swap
    our class for its ``AsyncScheduler`` variant when it is on (also for a class given
    with ``--scheduler-cls``), so GPU users keep the overlap of scheduling and execution."""
    variant = ASYNC_VARIANTS.get(scheduler_config.scheduler_cls)
    if variant is not None and scheduler_config.async_scheduling:
        scheduler_config.scheduler_cls = variant
        logger.info("async scheduling: scheduler class %s", variant)
