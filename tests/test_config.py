"""Configs, and the engine flags generated from them: defaults, help, and bad values
(a ValueError naming the field, or a one-line argparse error naming the flag)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from vllm.config import (
    CacheConfig,
    ModelConfig,
    OffloadConfig,
    PolicyConfig,
    SchedulerConfig,
    VllmConfig,
    field_default,
)
from vllm.engine.arg_utils import EngineArgs, config_args, parse_bytes
from vllm.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("factory", "field"),
    [
        (lambda: CacheConfig(block_size=3), "block_size"),
        (lambda: CacheConfig(num_gpu_blocks_override=1), "num_gpu_blocks_override"),
        (lambda: CacheConfig(gpu_memory_utilization=0), "gpu_memory_utilization"),
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (lambda: SchedulerConfig(policy="lifo"), "scheduling_policy"),
        (lambda: SchedulerConfig(stream_interval=0), "stream_interval"),
        (lambda: SamplingParams(stream_interval=0), "stream_interval"),
        (
            lambda: SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=16),
            "max_num_batched_tokens",
        ),
        (lambda: ModelConfig(max_model_len=0), "max_model_len"),
        (lambda: ModelConfig(dtype="int3"), "dtype"),
        (lambda: PolicyConfig(continuum_ttl_mode="forever"), "continuum_ttl_mode"),
        (lambda: PolicyConfig(max_ttl_s=-1), "max_ttl_s"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0), "top_p"),
        (lambda: SamplingParams(top_k=-5), "top_k"),
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(min_tokens=5, max_tokens=2), "min_tokens"),
        (lambda: SamplingParams(n=0), "n"),
        (lambda: SamplingParams(logprobs=-5), "logprobs"),
        (lambda: SamplingParams(stop=[""]), "stop"),
        (lambda: SamplingParams(extra_args={"job_id": 5}), "job_id"),
        (lambda: SamplingParams(extra_args={"job_id": "j", "is_last_step": "yes"}), "is_last_step"),
        (lambda: EngineArgs(kv_cache_memory="lots").create_engine_config(), "kv_cache_memory"),
        (lambda: EngineArgs(max_model_len=9000).create_engine_config(8192), "max_model_len"),
    ],
)
def test_bad_values_name_the_field(factory, field):
    with pytest.raises(ValueError, match=field):
        factory()


def test_kv_tier_without_prefix_caching_is_refused():
    """The tier finds blocks by their prefix hash: without prefix caching it could hold
    nothing (and a policy would offload into nothing), so the config refuses it."""
    no_caching = CacheConfig(enable_prefix_caching=False)
    tier = OffloadConfig(kv_offloading_size=0.01)
    with pytest.raises(ValueError) as e:
        VllmConfig(cache_config=no_caching, offload_config=tier)
    assert "--kv-offloading-size" in str(e.value) and "--no-enable-prefix-caching" in str(e.value)
    assert "\n" not in str(e.value)
    VllmConfig(offload_config=tier)  # with prefix caching (the default)
    VllmConfig(cache_config=no_caching)  # no tier


def test_sampling_params_agent_metadata_and_defaults():
    p = SamplingParams(
        stop="###", top_k=-1, extra_args={"job_id": "job_alpha", "is_last_step": True}
    )
    assert p.stop == ["###"] and p.top_k == 0
    assert p.job_id == "job_alpha" and p.is_last_step
    p.update_from_generation_config(2)
    assert 2 in p.all_stop_token_ids
    assert SamplingParams(ignore_eos=True).all_stop_token_ids == set()


def test_parse_bytes_and_engine_args_defaults():
    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1.5G") == int(1.5 * 2**30)
    cfg = EngineArgs(max_num_seqs=4, kv_cache_memory="64MiB").create_engine_config(2048)
    assert cfg.scheduler_config.max_model_len == 2048
    assert cfg.cache_config.kv_cache_memory_bytes == 64 * 2**20
    assert cfg.scheduler_config.max_num_seqs == 4


def test_block_size_256_is_accepted_for_flash_attn_pages():
    # flash-attn 2 reads a paged cache directly only with pages of a multiple of 256.
    assert CacheConfig(block_size=256).block_size == 256
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=512)


def _engine_parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser(prog="vllm serve", exit_on_error=False))


def _config_defaults() -> dict[str, object]:
    """dest -> the default declared on the config field behind the flag."""
    configs = typing.get_type_hints(VllmConfig)
    return {a.dest: field_default(configs[a.group], a.field) for a in config_args()}


def test_every_flag_defaults_to_its_config_field():
    actions = [a for a in _engine_parser()._actions if a.option_strings and a.dest != "help"]
    declared = _config_defaults()
    # vLLM's name of --kv-cache-memory, in bytes (unset: --kv-cache-memory's value).
    declared["kv_cache_memory_bytes"] = None
    assert {a.dest for a in actions} == set(declared)
    derived = {"max_num_batched_tokens"}  # computed from chunked prefill / max_model_len
    for action in actions:
        expected = None if action.dest in derived else declared[action.dest]
        assert action.default == expected, action.option_strings
        assert action.help and len(action.help) > 10, action.option_strings
    # EngineArgs() and the parser agree, and give the configs' own defaults.
    assert vars(_engine_parser().parse_args([])) == vars(EngineArgs())
    cfg = EngineArgs().create_engine_config()
    assert cfg.cache_config == CacheConfig() and cfg.policy_config == PolicyConfig()
    assert cfg.scheduler_config == SchedulerConfig()


def test_flags_keep_their_vllm_names():
    flags = {a.flag: (a.group, a.field) for a in config_args()}
    assert flags["--scheduling-policy"] == ("scheduler_config", "policy")
    assert flags["--kv-cache-memory"] == ("cache_config", "kv_cache_memory_bytes")
    assert flags["--continuum-max-ttl"] == ("policy_config", "max_ttl_s")
    assert flags["--continuum-default-ttl"] == ("policy_config", "default_ttl_s")
    assert flags["--continuum-min-records"] == ("policy_config", "min_records")
    assert flags["--max-wait-time"] == ("policy_config", "max_wait_s")
    # One --max-model-len: SchedulerConfig's copy is filled from ModelConfig's.
    assert flags["--max-model-len"] == ("model_config", "max_model_len")
    assert ("scheduler_config", "max_model_len") not in flags.values()


def test_flags_reach_the_configs():
    argv = "--no-enable-chunked-prefill --max-model-len 4096 --kv-cache-memory 1.5GiB "
    argv += "--scheduling-policy continuum --continuum-max-ttl 3 --max-wait-time 7 --dtype float16"
    argv += " --stream-interval 8"
    args = _engine_parser().parse_args(argv.split())
    cfg = EngineArgs.from_cli_args(args).create_engine_config(8192)
    assert cfg.cache_config.kv_cache_memory_bytes == int(1.5 * 2**30)
    assert cfg.scheduler_config.policy == "continuum"
    assert not cfg.scheduler_config.enable_chunked_prefill
    # Without chunking the derived budget holds one whole prompt.
    assert cfg.scheduler_config.max_num_batched_tokens == 4096
    assert cfg.scheduler_config.max_model_len == cfg.model_config.max_model_len == 4096
    assert cfg.policy_config.max_ttl_s == 3 and cfg.policy_config.max_wait_s == 7
    assert cfg.model_config.dtype == "float16"
    assert cfg.scheduler_config.stream_interval == 8


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--max-num-seqs", "many"], "--max-num-seqs"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--dtype", "int3"], "--dtype"),
        (["--scheduling-policy", "lifo"], "--scheduling-policy"),
        (["--continuum-ttl-mode", "forever"], "--continuum-ttl-mode"),
        (["--continuum-max-ttl", "long"], "--continuum-max-ttl"),
    ],
)
def test_bad_flag_value_is_one_line_naming_the_flag(argv, flag):
    with pytest.raises(argparse.ArgumentError) as e:
        _engine_parser().parse_args(argv)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_scheduling_policy_choices_are_read_when_the_parser_is_built(monkeypatch):
    from vllm_continuum.policy import registry

    monkeypatch.setitem(registry._REGISTRY, "lifo", "vllm_continuum.policy.plain:FCFSPolicy")
    assert _engine_parser().parse_args(["--scheduling-policy", "lifo"]).scheduling_policy == "lifo"
    assert SchedulerConfig(policy="lifo").policy == "lifo"


def test_every_config_field_is_declared_with_its_help():
    for cls in typing.get_type_hints(VllmConfig).values():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name}"


# -- the step budget's default on CUDA (vLLM's, by usage context and device memory) ---------
class _Props:
    def __init__(self, name: str, gib: int) -> None:
        self.name, self.total_memory = name, gib << 30


def _fake_gpu(monkeypatch, props: _Props | None) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: props is not None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


H100, A100, L4, B200 = (
    _Props("NVIDIA H100 80GB HBM3", 80),
    _Props("NVIDIA A100-SXM4-80GB", 80),
    _Props("NVIDIA L4", 24),
    _Props("NVIDIA B200", 180),
)


@pytest.mark.parametrize(
    ("gpu", "llm", "serve"),
    [(H100, 16384, 8192), (B200, 16384, 16384), (A100, 8192, 2048), (L4, 8192, 2048)],
)
def test_cuda_gets_vllms_step_budget_for_its_context(monkeypatch, gpu, llm, serve):
    from vllm.engine.arg_utils import UsageContext

    _fake_gpu(monkeypatch, gpu)

    def budget(context, **kwargs):
        cfg = EngineArgs(**kwargs).create_engine_config(8192, context)
        return cfg.scheduler_config.max_num_batched_tokens

    assert budget(UsageContext.LLM_CLASS) == llm
    assert budget(UsageContext.OPENAI_API_SERVER) == serve
    # The engine used directly keeps SchedulerConfig's default, as vLLM's fallback.
    assert budget(UsageContext.ENGINE_CONTEXT) == 2048
    # The flag wins; without chunking a whole prompt still fits in one step.
    assert budget(UsageContext.LLM_CLASS, max_num_batched_tokens=512) == 512
    no_chunking = dict(enable_chunked_prefill=False, max_model_len=32768)
    cfg = EngineArgs(**no_chunking).create_engine_config(32768, UsageContext.LLM_CLASS)
    assert cfg.scheduler_config.max_num_batched_tokens == 32768


def test_cpu_keeps_its_step_budget(monkeypatch):
    from vllm.engine.arg_utils import UsageContext

    _fake_gpu(monkeypatch, None)
    for context in UsageContext:
        cfg = EngineArgs().create_engine_config(8192, context)
        assert cfg.scheduler_config.max_num_batched_tokens == 2048


def test_llm_and_serve_say_who_they_are(monkeypatch):
    """The two front ends pass their usage context (the CUDA default depends on it)."""
    import inspect

    from vllm.entrypoints import llm
    from vllm.entrypoints.cli import serve

    assert "UsageContext.LLM_CLASS" in inspect.getsource(llm.LLM.__init__)
    assert "UsageContext.OPENAI_API_SERVER" in inspect.getsource(serve.build_config)


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_reading_the_default_creates_no_cuda_context():
    """The API server computes the default: it must not hold a CUDA context (GPU memory)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from vllm.engine.arg_utils import EngineArgs, UsageContext\n"
        "cfg = EngineArgs().create_engine_config(8192, UsageContext.OPENAI_API_SERVER)\n"
        "assert cfg.scheduler_config.max_num_batched_tokens >= 2048\n"
        "assert not torch._C._cuda_hasPrimaryContext(0), 'a CUDA context was created'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
