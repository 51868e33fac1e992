"""--kv-offloading-size / --kv-offloading-backend: defaults, parsing, one-line errors."""

from __future__ import annotations

import argparse

import pytest

import vllm.config as config_module
from vllm.config import OffloadConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs


def _parse(*argv: str) -> argparse.Namespace:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    return parser.parse_args(list(argv))


def test_off_by_default_and_parsed_in_gib():
    assert not VllmConfig().offload_config.enabled
    args = _parse("--kv-offloading-size", "0.5", "--kv-offloading-backend", "native")
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    oc = cfg.offload_config
    assert oc.enabled and oc.size_bytes == 2**29 and oc.kv_offloading_backend == "native"
    assert oc.num_blocks(720 * 1024) == 2**29 // (720 * 1024)
    assert EngineArgs(kv_offloading_size="1").create_engine_config().offload_config.size_bytes
    assert OffloadConfig().num_blocks(1) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-offloading-size", "lots"], "--kv-offloading-size must be a number of GiB"),
        (["--kv-offloading-backend", "nvme"], "--kv-offloading-backend"),
    ],
)
def test_bad_flags_are_one_line_argparse_errors(argv, message):
    with pytest.raises(argparse.ArgumentError, match=message) as e:
        _parse(*argv)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_offloading_size": -1.0}, "--kv-offloading-size must be a number of GiB >= 0"),
        ({"kv_offloading_size": "4"}, "--kv-offloading-size must be a number of GiB >= 0"),
        ({"kv_offloading_backend": "nvme"}, "--kv-offloading-backend must be one of"),
    ],
)
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        OffloadConfig(**kwargs)
    assert "\n" not in str(e.value)


def test_a_size_beyond_free_memory_is_refused(monkeypatch):
    monkeypatch.setattr(config_module, "available_host_memory", lambda: 2**30)
    assert OffloadConfig(kv_offloading_size=1.0).enabled
    with pytest.raises(ValueError, match="--kv-offloading-size .*more than the host memory"):
        OffloadConfig(kv_offloading_size=1.5)


def test_a_size_under_one_block_is_refused():
    with pytest.raises(ValueError, match="--kv-offloading-size .*holds no KV block"):
        OffloadConfig(kv_offloading_size=1e-9).num_blocks(720 * 1024)


def test_available_host_memory_is_positive():
    assert config_module.available_host_memory() > 0


def test_zero_turns_the_tier_off_and_unset_is_automatic(monkeypatch):
    off = OffloadConfig(kv_offloading_size=0)
    assert not off.enabled and not off.auto and off.num_blocks(1024) == 0
    unset = OffloadConfig()
    assert unset.auto and not unset.enabled
    monkeypatch.setattr(config_module, "available_host_memory", lambda: 64 * 2**30)
    assert unset.auto_size_bytes(2**30) == 16 * 2**30  # 16x the KV cache
    monkeypatch.setattr(config_module, "available_host_memory", lambda: 8 * 2**30)
    assert unset.auto_size_bytes(2**30) == 4 * 2**30  # at most half the free host memory
