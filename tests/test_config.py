"""Bad configuration and sampling values raise ValueError naming the field."""

from __future__ import annotations

import pytest

from vllm.config import CacheConfig, ModelConfig, PolicyConfig, SchedulerConfig
from vllm.engine.arg_utils import EngineArgs, parse_bytes
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
        (lambda: SamplingParams(logprobs=99), "logprobs"),
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
