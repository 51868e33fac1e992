"""The engine refuses to start when one request of --max-model-len tokens cannot fit the KV
pool sized from memory (as vLLM), instead of cutting such requests at the pool's size."""

from __future__ import annotations

import logging

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.core import EngineCore, check_kv_capacity


def test_max_model_len_over_the_pool_is_refused_naming_the_flag_and_capacity():
    config = EngineArgs(max_model_len=512, kv_cache_memory="64MiB").create_engine_config()
    check_kv_capacity(config, 33)  # 32 usable blocks of 16: exactly 512 tokens
    with pytest.raises(ValueError, match=r"--max-model-len 512 .* 496 tokens") as info:
        check_kv_capacity(config, 32)
    assert "--kv-cache-memory" in str(info.value)


def test_an_exact_block_count_is_taken_as_asked_with_a_warning(caplog):
    config = EngineArgs(max_model_len=512, num_gpu_blocks_override=8).create_engine_config()
    with caplog.at_level(logging.WARNING, logger="vllm.v1.engine.core"):
        check_kv_capacity(config, 8)
    assert "112 tokens" in caplog.text and "longer requests are refused" in caplog.text


def test_with_an_exact_pool_max_tokens_is_capped_at_the_pool(tokenizer):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.processor import Processor

    config = EngineArgs(max_model_len=512, num_gpu_blocks_override=8).create_engine_config()
    processor = Processor(config, tokenizer, None)
    processor.set_kv_capacity(8)  # 7 usable blocks of 16: 112 tokens
    assert processor.context_limit == 112
    prompt = list(range(100, 200))  # 100 tokens
    processor.process(prompt, SamplingParams(max_tokens=12), "fits")
    over = SamplingParams(max_tokens=13)
    processor.process(prompt, over, "over")  # capped at what the pool leaves, as vLLM caps
    assert over.max_tokens == 12
    with pytest.raises(VLLMValidationError, match="KV cache holds at most 112 tokens"):
        processor.process(list(range(100, 212)), SamplingParams(), "no room for one token")


def test_engine_core_start_fails_when_the_memory_holds_less_than_max_model_len():
    # SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 x 2 x 4 bytes = 45 KiB a token,
    # so 8 MiB is 11 blocks of 16: 160 tokens.
    config = EngineArgs(max_model_len=512, kv_cache_memory="8MiB").create_engine_config()
    with pytest.raises(ValueError, match="--max-model-len 512 .* 160 tokens"):
        EngineCore(config)
