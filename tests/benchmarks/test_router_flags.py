"""The flags ReplicaSet gives vllm-router, without starting it: the routing policy, the fast
failover, the Program layer (``program``) with our config, then the caller's flags."""

from __future__ import annotations

import json

import pytest

from vllm.benchmarks.router import (
    FAST_FAILOVER,
    ROUTING_POLICIES,
    make_parser,
    program_scheduling_config,
    router_flags,
)


def test_a_router_policy_is_passed_as_is_and_the_caller_s_flags_come_last():
    flags = router_flags("cache_aware", ["--cache-threshold", "0.9"])
    assert flags == ["--policy", "cache_aware", *FAST_FAILOVER, "--cache-threshold", "0.9"]


def test_program_is_the_program_layer_over_consistent_hash():
    config = program_scheduling_config(6400, overrides={"binding_only": True})
    flags = router_flags("program", ["--log-level", "debug"], config)
    assert flags[:2] == ["--policy", "consistent_hash"]
    i = flags.index("--enable-program-scheduling")
    assert flags[i + 1] == "--program-scheduling-config-json"
    assert json.loads(flags[i + 2]) == config
    assert flags[-2:] == ["--log-level", "debug"]
    # Omitted, the config is ours without a token capacity.
    default = router_flags("program")
    assert json.loads(default[default.index("--enable-program-scheduling") + 2]) == (
        program_scheduling_config()
    )


def test_our_program_config_opts_in_by_the_agentic_context_and_sizes_by_the_pool():
    config = program_scheduling_config(400 * 16)
    assert config["program_scheduling_enable_key"] == "vllm_xargs.agentic_context"
    assert config["binding_strategy"] == "consistent_hash" and config["global_queue"] is True
    assert config["token_capacity_per_dp_rank"] == 6400
    assert "token_capacity_per_dp_rank" not in program_scheduling_config()
    assert program_scheduling_config(overrides={"global_queue": False})["global_queue"] is False


@pytest.mark.parametrize(
    "policy, config", [("warp", None), ("round_robin", program_scheduling_config())]
)
def test_refused(policy, config):
    with pytest.raises(ValueError):
        router_flags(policy, (), config)


def test_the_launcher_offers_the_router_s_policies_and_program():
    choices = next(a for a in make_parser()._actions if a.dest == "policy").choices
    assert tuple(choices) == (*ROUTING_POLICIES, "program")
