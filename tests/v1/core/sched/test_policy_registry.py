"""The policy registry: one map from name to class feeds the factory, config and CLI."""

from __future__ import annotations

import argparse

import pytest

from vllm.config import SchedulerConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.clock import FakeClock
from vllm.v1.core.sched.policy import create_policy, make_request_queue
from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_continuum.metrics import MetricSpec
from vllm_continuum.policy import Policy, policy_names
from vllm_continuum.policy.registry import get_policy_class, policy_metrics, register_policy


def _config(name: str) -> VllmConfig:
    return VllmConfig(scheduler_config=SchedulerConfig(policy=name))


@pytest.mark.parametrize("name", policy_names())
def test_every_registered_name_builds_its_policy_and_queue(name):
    policy = create_policy(_config(name), decode=lambda ids: "", clock=FakeClock())
    assert isinstance(policy, Policy) and policy.name == name
    assert isinstance(make_request_queue(policy, FakeClock(), frozenset()), RequestQueue)


@pytest.mark.parametrize("name", policy_names())
@pytest.mark.parametrize("has_kv_tier", [False, True])
def test_create_policy_passes_the_engines_kv_tier(name, has_kv_tier):
    policy = create_policy(
        _config(name), decode=lambda ids: "", clock=FakeClock(), has_kv_tier=has_kv_tier
    )
    assert policy.has_tier is has_kv_tier


def test_a_scheduler_refuses_a_policy_built_for_another_tier():
    config = _config("fcfs")
    tiered = create_policy(config, has_kv_tier=True)
    with pytest.raises(ValueError, match="has_kv_tier=True"):
        Scheduler(config, 16, tiered)  # no CPU blocks: no tier
    plain = create_policy(config)
    with pytest.raises(ValueError, match="has_kv_tier=False"):
        Scheduler(config, 16, plain, num_cpu_blocks=8)


def test_every_policy_declares_its_metrics_as_data():
    metrics = policy_metrics()
    assert tuple(metrics) == policy_names()
    assert metrics["fcfs"] == () and metrics["continuum"] == ()
    names = {spec.name for spec in metrics["context_serve"]}
    assert "vllm:context_serve_decisions" in names
    assert all(isinstance(spec, MetricSpec) for specs in metrics.values() for spec in specs)


def test_names_without_implementation_do_not_exist():
    assert policy_names()[0] == "fcfs"
    assert "context_serve" in policy_names()
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(policy="offload_everything")  # not built: not offered
    with pytest.raises(ValueError, match="scheduling_policy"):
        get_policy_class("lifo")


def test_cli_choices_come_from_the_registry():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    action = next(a for a in parser._actions if a.dest == "scheduling_policy")
    assert tuple(action.choices) == policy_names()


def test_policy_that_reads_outputs_needs_decode():
    with pytest.raises(ValueError, match="decode"):
        create_policy(_config("continuum"))


def test_register_rejects_a_conflicting_name():
    with pytest.raises(ValueError, match="already registered"):
        register_policy("fcfs", "somewhere:Else")
    with pytest.raises(ValueError, match="module:Class"):
        register_policy("x", "no-colon")
