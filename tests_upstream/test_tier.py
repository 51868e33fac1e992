"""The plugin's host KV tier: upstream's KV offloading, sized and switched as in our engine."""

from __future__ import annotations

import copy
import logging

import pytest
from harness import make_scheduler

from vllm_continuum.tier import auto_tier_bytes
from vllm_continuum.upstream import cli, tier

GIB = 2**30


def engine_args_for(*flags):
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm.engine.arg_utils import AsyncEngineArgs

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(list(flags)))


@pytest.fixture
def offloading_device(monkeypatch):
    """A platform upstream offloads from: 80 GiB of device memory, 100 GiB free host."""
    monkeypatch.setattr(tier, "offloading_unsupported", lambda: None)
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform), "get_device_total_memory", classmethod(lambda cls, i=0: 80 * GIB)
    )
    monkeypatch.setattr(tier, "available_host_memory", lambda: 100 * GIB)


def test_continuum_gets_the_automatic_tier_where_upstream_can_offload(offloading_device):
    args = engine_args_for("--scheduling-policy", "continuum", "--gpu-memory-utilization", "0.5")
    cli.apply_policy(args)
    # 16 x the 40 GiB the KV cache may take at most, capped at half the 100 GiB free.
    assert args.kv_offloading_size == pytest.approx(50.0)
    assert auto_tier_bytes(40 * GIB, 100 * GIB) == 50 * GIB


def test_kv_cache_memory_bytes_bounds_the_pool(offloading_device):
    args = engine_args_for("--scheduling-policy", "continuum", "--kv-cache-memory-bytes", "1G")
    cli.apply_policy(args)
    assert args.kv_offloading_size * GIB == pytest.approx(16 * args.kv_cache_memory_bytes)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (("--scheduling-policy", "continuum", "--kv-offloading-size", "3"), 3.0),  # the user's
        (("--scheduling-policy", "continuum", "--kv-offloading-size", "0"), None),  # off
        (("--scheduling-policy", "continuum", "--no-enable-prefix-caching"), None),
        (("--scheduling-policy", "context_serve"), 50.0),
    ],
)
def test_the_users_size_and_switches_win(offloading_device, flags, expected):
    args = engine_args_for(*flags, "--gpu-memory-utilization", "0.5")
    cli.apply_policy(args)
    assert args.kv_offloading_size == (pytest.approx(expected) if expected else None)


def test_policies_without_a_tier_get_none(offloading_device):
    args = engine_args_for("--scheduling-policy", "fcfs")
    cli.apply_policy(args)  # upstream's own policy: untouched
    assert args.kv_offloading_size is None
    args = engine_args_for()
    tier.configure_tier(args, "fcfs")  # a registered policy that keeps no contexts
    assert args.kv_offloading_size is None


def test_upstreams_cpu_build_runs_without_a_tier_and_says_why(caplog):
    assert "CUDA-alike" in tier.offloading_unsupported()  # this machine: upstream's CPU build
    args = engine_args_for("--scheduling-policy", "continuum")
    with caplog.at_level(logging.INFO, logger=tier.__name__):
        cli.apply_policy(args)
    assert args.kv_offloading_size is None
    assert "without a host KV tier" in caplog.text


def test_the_policy_knows_whether_upstream_has_a_tier(vllm_config, monkeypatch):
    from vllm.config import KVTransferConfig
    from vllm_continuum.context_serve.config import ContextServeConfig

    assert not make_scheduler(vllm_config).agent_policy.has_tier
    with_tier = copy.copy(vllm_config)
    with_tier.kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both"
    )
    assert tier.has_kv_tier(with_tier) and not tier.has_kv_tier(vllm_config)
    # Building upstream's connector needs its worker side; the policy only needs the fact.
    from vllm_continuum.upstream import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "has_kv_tier", lambda config: True)
    s = make_scheduler(vllm_config)
    assert s.has_kv_tier and s.agent_policy.has_tier
    # Continuum's pins yield to other jobs' turns at once (the context comes back by a load).
    assert s.agent_policy.may_release_pins_for(
        s.info_of(_waiting_request()), own_job_pinned=False, num_running=1, now=0.0
    )
    # ContextServe offloads SLOW turns' contexts to the tier instead of dropping them.
    assert make_scheduler(
        vllm_config, context_serve=ContextServeConfig()
    ).core.cs_config.offload_slow
    monkeypatch.setattr(scheduler_module, "has_kv_tier", lambda config: False)
    s = make_scheduler(vllm_config)
    assert not s.agent_policy.may_release_pins_for(
        s.info_of(_waiting_request()), own_job_pinned=False, num_running=1, now=0.0
    )
    assert not make_scheduler(
        vllm_config, context_serve=ContextServeConfig()
    ).core.cs_config.offload_slow


def _waiting_request():
    from conftest import make_request

    return make_request([1, 2, 3], job="j", arrival=0.0)
