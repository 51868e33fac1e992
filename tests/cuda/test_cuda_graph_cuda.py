"""Decode steps captured in real CUDA graphs (``vllm/v1/worker/cuda_graph.py``): a tiny
random Llama in bf16 on TORCH_FLASH_ATTN with the Triton decode kernel.

- A replayed step equals the eager forward of the same padded batch (same kernels, same
  shapes), over new lengths, block tables and token ids each step, and writes the cache
  where eager writes it (padding: the null block only).
- ``ModelRunner`` captures at start-up, replays decode steps and gives the eager runner's
  greedy tokens on a short run (``--enforce-eager``: no graphs), all but a rare bf16
  near-tie (a padded batch may take other GEMM kernels than the eager one).

Run with ``pytest -m cuda tests`` on a CUDA machine with triton; skipped without one.
The same plumbing runs on the CPU with stand-in graphs in tests/v1/worker/test_cuda_graph.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.tiny_models import save_tiny_llama
from tests.v1.worker.test_cuda_graph import random_decodes, run_steps
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

BLOCK = 4
NUM_BLOCKS = 64  # random_decodes' range
MAX_LEN = 96


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-graphs-cuda")
    save_tiny_llama(path)
    return path


def cuda_runner(checkpoint, **model) -> ModelRunner:
    config = VllmConfig(
        model_config=ModelConfig(model=str(checkpoint), dtype="bfloat16", **model),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_model_len=MAX_LEN, max_num_batched_tokens=96, max_num_seqs=8
        ),
    )
    runner = ModelRunner(config, device="cuda")
    runner.load_model()
    assert runner.attn_backend.name == "TORCH_FLASH_ATTN", runner.attn_backend.name
    assert runner.attn_backend.decode_kernel == "triton"
    runner.initialize_kv_cache(NUM_BLOCKS)
    return runner


@torch.inference_mode()
def test_replay_equals_the_eager_padded_step(checkpoint):
    runner = cuda_runner(checkpoint)
    for cache in runner.kv_caches:
        cache.normal_()
    runner.capture_model()
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    eager_caches = [c.clone() for c in runner.kv_caches]
    for step, n in enumerate([3, 1, 8, 5, 2, 7]):
        ids, positions, seqs = random_decodes(n, seed=step)
        replayed = graphs.run(ids, positions, seqs).clone()
        size = graphs.padded_size(seqs)
        pad = size - n
        meta = runner.attn_backend.build_metadata(seqs + [(0, 1, [0])] * pad)
        eager = runner.model(
            torch.tensor(ids + [0] * pad, device="cuda"),
            torch.tensor(positions + [0] * pad, device="cuda"),
            meta,
            eager_caches,
        )[:n]
        torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-2)
        for cache, ref in zip(runner.kv_caches, eager_caches, strict=True):
            torch.testing.assert_close(cache[:, 1:], ref[:, 1:], rtol=0, atol=1e-2)
    assert graphs.num_replays == 6


def test_runner_replays_with_the_eager_tokens(checkpoint):
    eager = cuda_runner(checkpoint, enforce_eager=True)
    eager.capture_model()
    assert eager.decode_graphs is None
    expected = run_steps(eager)
    runner = cuda_runner(checkpoint)
    runner.capture_model()
    got = run_steps(runner)
    assert runner.decode_graphs.num_replays == 6
    pairs = [(e[r], g.get(r)) for e, g in zip(expected, got, strict=True) for r in e]
    assert sum(a == b for a, b in pairs) >= 0.9 * len(pairs), pairs
