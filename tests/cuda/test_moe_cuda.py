"""Mixture-of-experts on CUDA (``layers/fused_moe.py``): the grouped GEMM in bf16, the loop
in fp32 (the dense path under capture), each captured in a CUDA graph and replayed over
new tokens and routing, and a Qwen3-MoE checkpoint served in fp32 with graphs giving
transformers' greedy tokens. The CPU tests
are tests/model_executor/test_moe.py.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.test_moe import random_experts, reference_experts, save_checkpoint
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
