"""A tiny random DeepSeek-V2 (V2-Lite's layout: q straight from the hidden state, a dense
first layer, shared experts) on CUDA in bf16 through ``TRITON_MLA``: the latent cache,
prefill chunks on the Triton MLA prefill kernel, decode steps on the Triton MLA decode
kernel replayed from CUDA graphs. Its logits over a 100-token prompt, over the same prompt
in three chunks (each over the cached rows of the ones before), and the same tokens
teacher-forced one replayed decode step at a time, are within bf16 rounding of the same
engine's logits on the CPU (whose fp32 logits tests/model_executor/test_deepseek.py holds
to transformers'), with the cache in bf16 and in FP8 (the CPU reading the same FP8
values). The kernels alone against float64: ``test_real_kernel_matches_float64`` in
tests/v1/attention/test_triton_mla_decode.py and test_triton_mla_prefill.py.

Run with ``pytest -m cuda tests`` on a CUDA machine with triton; skipped without one.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.model_executor.test_deepseek import TINY, save
from tests.tiny_models import load_cpu_runner, runner_logits
from tests.v1.attention.test_triton_mla import chunked_logits, replayed_logits
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

PREFIX = 60  # prompt tokens prefilled before the teacher-forced decode steps


def config(path, cache_dtype: str) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(path), dtype="bfloat16", max_model_len=128),
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
        scheduler_config=SchedulerConfig(
            max_model_len=128, max_num_batched_tokens=128, max_num_seqs=8
        ),
    )


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_deepseek_on_triton_mla_with_graphs_matches_the_cpu(cache_dtype, tmp_path):
    save("v2_lite", tmp_path)
    runner = ModelRunner(config(tmp_path, cache_dtype), device="cuda")
    runner.load_model()
    assert runner.attn_backend.name == "TRITON_MLA" and runner.attn_backend.prefill_kernel
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (100,), generator=g)
    ours = runner_logits(runner, ids.cuda()).float().cpu()  # a 100-token prompt: the kernel
    chunked = chunked_logits(runner, ids.cuda(), [37, 40, 23])
    assert runner.kv_caches[0].shape[0] == 1  # the latent cache: keys only
    runner.warm_up_kernels()
    runner.capture_model()
    assert runner.decode_graphs is not None
    decoded = replayed_logits(runner, ids.cuda(), PREFIX)
    cpu = load_cpu_runner(config(tmp_path, cache_dtype))
    assert cpu.attn_backend.name == "TORCH_SDPA"
    ref = runner_logits(cpu, ids).float()
    for got, want in ((ours, ref), (chunked, ref), (decoded, ref[PREFIX:])):
        err = (got - want).abs().max()
        assert err < 0.05 * want.abs().max(), (err, want.abs().max())
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    runner.release()
