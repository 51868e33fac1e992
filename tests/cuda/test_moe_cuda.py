"""Mixture-of-experts on CUDA (``layers/fused_moe.py``): the grouped GEMM in bf16, the loop
in fp32 (the dense path under capture), each captured in a CUDA graph and replayed over
new tokens and routing, and a Qwen3-MoE checkpoint served in fp32 with graphs giving
transformers' greedy tokens. Packed MXFP4 experts (gpt-oss): ``FusedMoE`` on the Triton
kernel against the same experts expanded to bf16 (the grouped GEMM), eager and captured
in a CUDA graph; a tiny gpt-oss MXFP4 checkpoint's logits packed against expanded, the
memory its experts take, its decode steps replayed from the runner's graphs against the
eager step, and the engine in fp32 giving transformers' greedy tokens.
The CPU tests are tests/model_executor/test_moe.py and test_triton_mxfp4_moe.py.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.test_gpt_oss import IDS, save_mxfp4_checkpoint
from tests.model_executor.test_moe import (
    packed_experts,
    random_experts,
    reference_experts,
    save_checkpoint,
)
from tests.tiny_models import runner_logits
from tests.utils import copy_benchmark_tokenizer
from vllm.model_executor.layers import fused_moe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_on_cuda_equal_the_reference_eager_and_replayed(dtype):
    layer, x, logits = random_experts(16, dtype)
    layer, x, logits = layer.cuda(), x.cuda(), logits.cuda()
    grouped = dtype == torch.bfloat16 and torch.cuda.get_device_capability() >= (8, 0)
    assert fused_moe.grouped_mm_supported(x, layer.w13) == grouped
    with torch.inference_mode():
        eager = layer(x, logits)
        weights, ids = fused_moe.select_experts(logits, layer.top_k, layer.renormalize)
        ref = reference_experts(x.cpu(), layer.w13.cpu(), layer.w2.cpu(), weights.cpu(), ids.cpu())
        torch.testing.assert_close(eager.float().cpu(), ref, **TOL[dtype])
        # Captured (fp32: the dense path, as under the runner's capture), then replayed
        # over other tokens and routing written into the same buffers.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x, logits)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, logits)
        _, x2, logits2 = random_experts(16, dtype)
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        torch.cuda.synchronize()
        weights, ids = fused_moe.select_experts(logits2, layer.top_k, layer.renormalize)
        ref = reference_experts(x2, layer.w13.cpu(), layer.w2.cpu(), weights, ids)
        torch.testing.assert_close(out.float().cpu(), ref, **TOL[dtype])


def test_qwen3_moe_served_with_graphs_gives_transformers_greedy_tokens(tmp_path):
    """fp32: eager steps take the loop, captured decode steps the dense path."""
    from vllm import LLM, SamplingParams

    hf = save_checkpoint(
        "Qwen3MoeForCausalLM", tmp_path, vocab_size=49152, max_position_embeddings=512
    )
    copy_benchmark_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (9, 33, 70)]
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :]
            for p in prompts
        ]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=512, max_num_seqs=4)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == [e.tolist() for e in expected]


def capture(fn):
    """``fn()`` captured in a CUDA graph after a warm-up on a side stream: (graph, out)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiles the Triton kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_packed_mxfp4_experts_equal_the_expanded_bf16_ones_eager_and_replayed(num_tokens):
    packed, dense, x, logits = packed_experts(num_tokens, torch.bfloat16)
    packed, dense, x, logits = packed.cuda(), dense.cuda(), x.cuda(), logits.cuda()
    assert packed.w13_blocks.is_cuda and fused_moe.grouped_mm_supported(x, dense.w13)
    with torch.inference_mode():
        ref = dense(x, logits).float()
        err = (packed(x, logits).float() - ref).abs().max()
        assert err <= 2e-2 * ref.abs().max(), (err, ref.abs().max())  # bf16 h, ~1 ulp
        graph, out = capture(lambda: packed(x, logits))
        _, _, x2, logits2 = packed_experts(num_tokens, torch.bfloat16, seed=1)
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        torch.cuda.synchronize()
        ref = dense(x, logits).float()
        err = (out.float() - ref).abs().max()
        assert err <= 2e-2 * ref.abs().max(), (err, ref.abs().max())


def _cuda_runner(path, monkeypatch, mode: str):
    """A bf16 runner on CUDA with gpt-oss's experts ``VLLM_MXFP4_MOE=mode``, loaded."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.worker.model_runner import ModelRunner

    monkeypatch.setenv("VLLM_MXFP4_MOE", mode)
    model_config = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=128)
    runner = ModelRunner(VllmConfig(model_config=model_config), device="cuda")
    runner.load_model()
    return runner


def test_gpt_oss_mxfp4_checkpoint_packed_gives_the_expanded_logits(tmp_path, monkeypatch):
    save_mxfp4_checkpoint(tmp_path)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    packed = _cuda_runner(tmp_path, monkeypatch, "auto")
    packed_bytes = torch.cuda.memory_allocated() - before
    experts = packed.model.layers[0].mlp.experts
    assert experts.mxfp4 and experts.w13_blocks.is_cuda
    ours = runner_logits(packed, IDS.cuda()).float().cpu()
    packed.release()
    del packed, experts
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    dense = _cuda_runner(tmp_path, monkeypatch, "dequantize")
    dense_bytes = torch.cuda.memory_allocated() - before
    assert not dense.model.layers[0].mlp.experts.mxfp4
    ref = runner_logits(dense, IDS.cuda()).float().cpu()
    dense.release()
    err = (ours - ref).abs().max()
    assert err < 0.05 * ref.abs().max(), (err, ref.abs().max())
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    # Per layer the bf16 experts take 2 * E * (3 * I * H) bytes, the packed ones 17/32 of a
    # byte a value (half a byte, plus a scale byte per 32): ~3.8x less.
    assert packed_bytes < dense_bytes, (packed_bytes, dense_bytes)


@torch.inference_mode()
def test_gpt_oss_packed_decode_steps_replay_as_the_eager_padded_step(tmp_path):
    """bf16 on TORCH_FLASH_ATTN (sinks and windows in the Triton decode kernel): decode
    steps of 3, 1, 8 and 5 sequences through the packed experts, replayed from the
    runner's graphs, equal the eager forward of the same padded batch."""
    from tests.v1.worker.test_cuda_graph import random_decodes
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.worker.model_runner import ModelRunner

    save_mxfp4_checkpoint(tmp_path)
    config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), dtype="bfloat16"),
        cache_config=CacheConfig(block_size=4),  # random_decodes' layout
        scheduler_config=SchedulerConfig(
            max_model_len=96, max_num_batched_tokens=96, max_num_seqs=8
        ),
    )
    runner = ModelRunner(config, device="cuda")
    runner.load_model()
    assert runner.model.layers[0].mlp.experts.mxfp4
    assert runner.attn_backend.name == "TORCH_FLASH_ATTN", runner.attn_backend.name
    runner.initialize_kv_cache(64)
    for cache in runner.kv_caches:
        cache.normal_()
    runner.capture_model()
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    eager_caches = [c.clone() for c in runner.kv_caches]
    for step, n in enumerate([3, 1, 8, 5]):
        ids, positions, seqs = random_decodes(n, seed=step)
        before = [c.clone() for c in eager_caches]
        replayed = graphs.run(ids, positions, seqs).clone()
        pad = graphs.padded_size(seqs) - n
        meta = runner.attn_backend.build_metadata(seqs + [(0, 1, [0])] * pad)
        inputs = (
            torch.tensor(ids + [0] * pad, device="cuda"),
            torch.tensor(positions + [0] * pad, device="cuda"),
            meta,
        )
        eager = runner.model(*inputs, eager_caches)[:n]
        if not torch.allclose(replayed, eager, rtol=0, atol=1e-2):
            # What the next GPU session needs to tell a graph fault from rounding: is the
            # eager step deterministic (again from the caches before it), how far apart the
            # graph's and the eager caches are after it, which rows.
            again = runner.model(*inputs, before)[:n]
            pairs = zip(runner.kv_caches, eager_caches, strict=True)
            caches = max(float((a - b).abs().max()) for a, b in pairs)
            rows = (replayed - eager).abs().amax(-1).tolist()
            detail = dict(step=step, n=n, pad=pad, row_errors=rows, eager_repeat_error=float(
                (again - eager).abs().max()), caches_apart=caches)  # fmt: skip
            raise AssertionError(f"replayed != eager: {detail}")
    assert graphs.num_replays == 4
    runner.release()


def test_gpt_oss_mxfp4_served_gives_transformers_greedy_tokens(tmp_path):
    """fp32 (so that greedy tokens cannot flip on rounding; FlashAttention takes no fp32,
    so these steps run eagerly on TORCH_SDPA): the packed experts in every step against
    transformers on the expanded values."""
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.gpt_oss import keep_mxfp4_packed

    assert keep_mxfp4_packed(), "VLLM_MXFP4_MOE=dequantize or no triton: nothing to test"
    hf = save_mxfp4_checkpoint(tmp_path, vocab_size=49152)
    copy_benchmark_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (9, 33, 70)]
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :]
            for p in prompts
        ]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, max_num_seqs=4)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == [e.tolist() for e in expected]
