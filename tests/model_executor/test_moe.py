"""Mixture-of-experts models (``models/moe.py``, ``layers/fused_moe.py``): Mixtral, Qwen2-MoE
and Qwen3-MoE checkpoints written by transformers give transformers' logits; the grouped
GEMM, its eager fallback and the capture-safe dense path compute the same experts; the
engine's greedy tokens equal transformers' ``generate``."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tests.tiny_models import (
    TINY_LLAMA,
    check_engine_greedy_matches,
    load_cpu_runner,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.layers import fused_moe
from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts
from vllm.model_executor.models.moe import MoeForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

# HF config fields per architecture (over TINY_LLAMA's): Qwen3 with a dense layer kept by
# mlp_only_layers, Qwen2 with its shared expert and without renormalisation.
MOE = {
    "Qwen3MoeForCausalLM": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, mlp_only_layers=[1]),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2),
    "Qwen2MoeForCausalLM": dict(moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    # OLMoE: q/k norms over the whole projection, q/k/v clipped (0.5 binds here).
    "OlmoeForCausalLM": dict(num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                             clip_qkv=0.5),
    # Granite MoE: Granite's four scalars, none of them 1; experts stored stacked.
    "GraniteMoeForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2,
                                  embedding_multiplier=12.0, attention_multiplier=0.1,
                                  residual_multiplier=0.22, logits_scaling=8.0),
    # GLM-4.5: sigmoid routing within the best 2 of 4 groups, a dense first layer, an
    # ungated shared expert, q/k norms, half the head rotated, q/k/v biases.
    "Glm4MoeForCausalLM": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                               n_shared_experts=1, first_k_dense_replace=1, n_group=4,
                               topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                               use_qk_norm=True, attention_bias=True, head_dim=16),
}  # fmt: skip


def moe_config(arch: str, **overrides):
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return config_cls(**{**TINY_LLAMA, **MOE[arch], **overrides})


def save_checkpoint(arch: str, path, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(transformers, arch)(moe_config(arch, **overrides)).eval()
    with torch.no_grad():  # GLM's routing correction starts at 0: make it choose
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", list(MOE))
def test_moe_architecture_resolves_to_the_moe_implementation(arch):
    assert ModelRegistry.resolve_model_cls(moe_config(arch))[0] is MoeForCausalLM


@pytest.mark.parametrize("arch", list(MOE))
def test_moe_checkpoint_logits_equal_transformers(arch, tmp_path):
    hf = save_checkpoint(arch, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    model = runner.model
    sparse = [layer.mlp is not None for layer in model.layers]
    glm = arch.startswith("Glm")
    assert sparse == ([True, False] if arch.startswith("Qwen3") else [not glm, True])
    assert runner.arch.attention_bias == (arch.startswith("Qwen2") or glm)
    assert runner.arch.qk_norm == (arch.startswith("Qwen3") or glm)
    assert runner.arch.qk_norm_full == (runner.arch.clip_qkv == 0.5) == arch.startswith("Olmoe")
    ids = torch.randint(
        0, TINY_LLAMA["vocab_size"], (100,), generator=torch.Generator().manual_seed(1)
    )
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    # The routing is not trivial: the tokens of the first sparse layer reach every expert.
    mlp = next(layer.mlp for layer in model.layers if layer.mlp is not None)
    with torch.inference_mode():
        logits = mlp.gate(torch.randn(100, TINY_LLAMA["hidden_size"]))
    _, chosen = select_experts(logits, 2, True)
    assert chosen.unique().numel() == model.arch.num_experts


def test_decoder_sparse_step_keeps_the_other_layers_dense(tmp_path):
    arch = "Qwen2MoeForCausalLM"
    hf = save_checkpoint(arch, tmp_path, decoder_sparse_step=2, num_hidden_layers=3)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert [layer.mlp is not None for layer in runner.model.layers] == [False, True, False]
    ids = torch.arange(40) % TINY_LLAMA["vocab_size"]
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(runner_logits(runner, ids), ref, atol=1e-4)


def reference_experts(x, w13, w2, weights, ids) -> torch.Tensor:
    """Token by token, slot by slot, in fp32."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = ids[t, slot]
            gate, up = (w13[e] @ x[t]).split(inter)
            out[t] += weights[t, slot] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


def random_experts(num_tokens: int, dtype: torch.dtype, num_experts=8, top_k=3, hidden=64):
    g = torch.Generator().manual_seed(num_tokens)
    layer = FusedMoE(num_experts, top_k, hidden, 48, renormalize=True).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    return layer, x, logits


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_fallback_and_dense_paths_equal_the_reference(num_tokens, dtype, monkeypatch):
    layer, x, logits = random_experts(num_tokens, dtype)
    weights, ids = select_experts(logits, layer.top_k, layer.renormalize)
    torch.testing.assert_close(weights.sum(-1), torch.ones(num_tokens))
    ref = reference_experts(x, layer.w13, layer.w2, weights, ids)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    assert fused_moe.grouped_mm_supported(x, layer.w13)
    with torch.inference_mode():
        grouped = layer(x, logits)
        dense = fused_moe._dense_experts(x, layer.w13, layer.w2, weights, ids)
        monkeypatch.setattr(fused_moe, "grouped_mm_supported", lambda a, w: False)
        looped = layer(x, logits)
    for out in (grouped, dense, looped):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, **tol)


def test_rows_the_grouped_gemm_cannot_take_use_the_loop():
    layer, x, logits = random_experts(7, torch.float16)
    assert not fused_moe.grouped_mm_supported(x, layer.w13)
    weights, ids = select_experts(logits, layer.top_k, layer.renormalize)
    with torch.inference_mode():
        out = layer(x, logits)
    ref = reference_experts(x, layer.w13, layer.w2, weights, ids)
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)
    unaligned = torch.zeros(7 * 64 + 1)[1:].view(7, 64)  # rows 4 bytes off 16
    assert not fused_moe.grouped_mm_supported(unaligned, layer.w13.float())


def test_without_renormalisation_weights_are_the_softmax_probabilities():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    with pytest.raises(ValueError, match="top_k"):
        FusedMoE(4, 5, 8, 8, renormalize=True)


def test_unsupported_activation_is_refused():
    config = moe_config("MixtralForCausalLM", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        MoeForCausalLM.arch_from_hf(config)


def test_gguf_quantization_of_a_moe_model_is_refused():
    from vllm.model_executor.layers.quantization.gguf import model_gguf_layout

    with torch.device("meta"):
        model = MoeForCausalLM(MoeForCausalLM.arch_from_hf(moe_config("MixtralForCausalLM")))
    with pytest.raises(ValueError, match="MoeForCausalLM declares no gguf_layout"):
        model_gguf_layout(model)


def test_dummy_weights_fill_the_experts(tmp_path):
    from vllm.model_executor.model_loader import DUMMY_WEIGHT_BOUND, load_model_weights

    config = moe_config("Qwen3MoeForCausalLM")
    model = load_model_weights(MoeForCausalLM, config, str(tmp_path), "cpu", torch.float32, "dummy")
    experts = model.layers[0].mlp.experts
    for w in (experts.w13, experts.w2):
        assert w.abs().max() <= DUMMY_WEIGHT_BOUND and w.std() > DUMMY_WEIGHT_BOUND / 4


def test_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """The engine (chunked prefill, a batch of decodes, a prefix hit) on a Qwen3-MoE
    checkpoint with the embedded model's tokenizer: transformers' greedy tokens."""
    hf = save_checkpoint(
        "Qwen3MoeForCausalLM", tmp_path, vocab_size=49152, max_position_embeddings=256
    )
    check_engine_greedy_matches(hf, tmp_path)


def packed_experts(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    """A gpt-oss-style layer (swigluoai, biases) over random MXFP4 experts, the same layer
    with them expanded, and a batch: (packed, dense, x, logits)."""
    from vllm.model_executor.layers.fused_moe import Activation
    from vllm.model_executor.models.gpt_oss import dequantize_mxfp4

    g = torch.Generator().manual_seed(seed)
    packed, dense = (
        FusedMoE(8, 3, 64, 96, True, Activation("swigluoai"), True, mxfp4=m).to(dtype)
        for m in (True, False)
    )
    with torch.no_grad():
        for name in ("w13", "w2"):
            blocks, scales = getattr(packed, name + "_blocks"), getattr(packed, name + "_scales")
            blocks.copy_(torch.randint(0, 256, blocks.shape, generator=g))
            scales.copy_(torch.randint(121, 125, scales.shape, generator=g))
            getattr(dense, name).copy_(dequantize_mxfp4(blocks, scales))
        for name in ("w13_bias", "w2_bias"):
            bias = torch.randn(getattr(packed, name).shape, generator=g)
            getattr(packed, name).copy_(bias)
            getattr(dense, name).copy_(bias)
    x = torch.randn(num_tokens, 64, generator=g).to(dtype)
    return packed, dense, x, torch.randn(num_tokens, 8, generator=g)


def emulated_mxfp4_kernel(calls: list):
    """``mxfp4_grouped_linear`` in float64 (the expanded weights, each row through the
    expert whose range holds it), checking the kernel's contract, its calls recorded."""
    from vllm.model_executor.models.gpt_oss import dequantize_mxfp4

    def kernel(x, blocks, scales, expert_ends, bias=None):
        assert expert_ends.dtype == torch.int32 and expert_ends.shape == (blocks.shape[0],)
        assert x.shape[1] == blocks.shape[2] * 32 and x.is_contiguous()
        calls.append((x.shape[0], blocks.shape[1], expert_ends.tolist()))
        w = dequantize_mxfp4(blocks, scales, torch.float64)
        out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
        start = 0
        for e, end in enumerate(expert_ends.tolist()):
            out[start:end] = x[start:end].double() @ w[e].T
            if bias is not None:
                out[start:end] += bias[e].double()
            start = end
        return out.to(x.dtype)

    return kernel


@pytest.mark.parametrize("num_tokens", [1, 6, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_run_both_gemms_in_the_mxfp4_kernel(num_tokens, dtype, monkeypatch):
    from vllm.model_executor.layers import triton_mxfp4_moe

    calls = []
    monkeypatch.setattr(triton_mxfp4_moe, "mxfp4_grouped_linear", emulated_mxfp4_kernel(calls))
    packed, dense, x, logits = packed_experts(num_tokens, dtype)
    assert packed.w13 is None and packed.w2 is None and "w13_blocks" in packed.state_dict()
    with torch.inference_mode():
        out, ref = packed(x, logits), dense(x, logits)
    pairs = num_tokens * packed.top_k
    _, ids = select_experts(logits, packed.top_k, packed.renormalize)
    ends = torch.bincount(ids.flatten(), minlength=8).cumsum(0).tolist()
    assert calls == [(pairs, 2 * 96, ends), (pairs, 64, ends)]  # gate/up, then down
    assert out.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_packed_experts_trade_for_dense_weights():
    packed, _, _, _ = packed_experts(1, torch.bfloat16)
    packed.use_dense_weights(torch.bfloat16)
    assert not packed.mxfp4 and not any(n.endswith(("_blocks", "_scales")) for n, _ in
                                        packed.named_buffers())  # fmt: skip
    assert packed.w13.shape == (8, 192, 64) and packed.w2.dtype == torch.bfloat16
    assert sorted(n for n, _ in packed.named_parameters()) == ["w13", "w13_bias", "w2", "w2_bias"]
    with pytest.raises(ValueError, match="multiples of 32"):
        FusedMoE(4, 2, 48, 64, True, mxfp4=True)


def test_packed_experts_read_nothing_on_the_host(monkeypatch):
    """On FakeTensorMode's CUDA tensors (no data: any host read raises) the routing, the
    sort and the combine around the kernel: a decode step can be captured."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vllm.model_executor.layers import triton_mxfp4_moe
    from vllm.model_executor.layers.fused_moe import Activation

    seen = []

    def launch(x, blocks, scales, expert_ends, bias=None):
        seen.append(expert_ends.device.type)
        return x.new_empty(x.shape[0], blocks.shape[1])

    monkeypatch.setattr(triton_mxfp4_moe, "mxfp4_grouped_linear", launch)
    with FakeTensorMode(), torch.device("cuda", 0):
        packed = FusedMoE(8, 3, 64, 96, True, Activation("swigluoai"), True, mxfp4=True)
        out = packed(torch.randn(4, 64), torch.randn(4, 8))
    assert out.shape == (4, 64) and out.device.type == "cuda" and seen == ["cuda", "cuda"]


def fp8_experts(num_tokens: int, dtype: torch.dtype, block, seed: int = 0):
    """A SiLU layer over random FP8 experts (``block`` scales, or per row with None), the
    same layer with them dequantized, and a batch: (fp8, dense, x, logits)."""
    g = torch.Generator().manual_seed(seed)
    fp8 = FusedMoE(8, 3, 64, 96, True)
    fp8.use_fp8_weights(block)
    fp8 = fp8.to(dtype)
    with torch.no_grad():
        for name in ("w13", "w2"):
            weight, scale = getattr(fp8, name + "_weight"), getattr(fp8, name + "_scale")
            b = torch.randint(0, 256, weight.shape, generator=g, dtype=torch.uint8)
            b[(b & 0x7F) == 0x7F] = 0  # no NaNs
            weight.copy_(b.view(torch.float8_e4m3fn))
            scale.copy_(torch.rand(scale.shape, generator=g) * 2e-3 + 1e-3)
    dense = copy.deepcopy(fp8)
    dense.dequantize_fp8_weights(dtype)
    x = torch.randn(num_tokens, 64, generator=g).to(dtype)
    return fp8, dense, x, torch.randn(num_tokens, 8, generator=g)


def emulated_fp8_grouped_kernel(calls: list):
    """``fp8_grouped_linear`` in float64 (each row through the expert whose range holds it,
    the weight times its block or row scales), checking the kernel's contract."""

    def kernel(x, weight, scale, block, expert_ends):
        assert expert_ends.dtype == torch.int32 and expert_ends.shape == (weight.shape[0],)
        assert x.shape[1] == weight.shape[2] and x.is_contiguous()
        assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        calls.append((x.shape[0], weight.shape[1], expert_ends.tolist()))
        b0, b1 = block or (1, weight.shape[2])
        out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float64)
        start = 0
        for e, end in enumerate(expert_ends.tolist()):
            s = scale[e].double().repeat_interleave(b0, 0).repeat_interleave(b1, 1)
            w = weight[e].double() * s[: weight.shape[1], : weight.shape[2]]
            out[start:end] = x[start:end].double() @ w.T
            start = end
        return out.to(x.dtype)

    return kernel


@pytest.mark.parametrize("block", [(32, 32), (16, 64), None])
@pytest.mark.parametrize("num_tokens", [1, 6, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_run_both_gemms_in_the_fp8_kernel(num_tokens, dtype, block, monkeypatch):
    from vllm.model_executor.layers import triton_fp8_gemm

    calls = []
    monkeypatch.setattr(triton_fp8_gemm, "fp8_grouped_linear", emulated_fp8_grouped_kernel(calls))
    fp8, dense, x, logits = fp8_experts(num_tokens, dtype, block)
    assert fp8.w13 is None and fp8.w13_weight.dtype == torch.float8_e4m3fn
    assert fp8.w13_scale.dtype == torch.float32  # kept through .to(dtype)
    assert not dense.fp8 and dense.w13.dtype == dtype and "w13_weight" not in dense.state_dict()
    with torch.inference_mode():
        out, ref = fp8(x, logits), dense(x, logits)
    pairs = num_tokens * fp8.top_k
    _, ids = select_experts(logits, fp8.top_k, fp8.renormalize)
    ends = torch.bincount(ids.flatten(), minlength=8).cumsum(0).tolist()
    assert calls == [(pairs, 2 * 96, ends), (pairs, 64, ends)]  # gate/up, then down
    assert out.dtype == dtype
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_fp8_experts_dequantize_exactly_and_refuse_what_they_cannot_hold():
    fp8, dense, _, _ = fp8_experts(1, torch.float32, (32, 32))
    w = fp8.w13_weight[2].float()
    s = fp8.w13_scale[2].repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(dense.w13[2], w * s)  # (192, 64) in 6 x 2 blocks
    rows, rows_dense, _, _ = fp8_experts(1, torch.float32, None)
    assert rows.w2_scale.shape == (8, 64, 1)
    assert torch.equal(rows_dense.w2[5], rows.w2_weight[5].float() * rows.w2_scale[5])
    assert FusedMoE(4, 2, 64, 96, True).fp8_unsupported_reason((64, 64)) is not None
    with pytest.raises(ValueError, match="ends inside a 64-row block"):
        FusedMoE(4, 2, 64, 96, True).use_fp8_weights((64, 64))
    with pytest.raises(ValueError, match="packed or biased"):
        FusedMoE(4, 2, 64, 96, True, has_bias=True).use_fp8_weights(None)
    with pytest.raises(ValueError, match="FP8 checkpoint's weights"):
        rows.load_expert(0, torch.zeros(96, 64), torch.zeros(96, 64), torch.zeros(64, 96))


def test_fp8_weight_bytes_counts_fp8_and_dense_experts():
    from vllm.model_executor.layers.quantization.fp8 import fp8_weight_bytes

    fp8, dense, _, _ = fp8_experts(1, torch.bfloat16, (32, 32))
    weights = 8 * (192 * 64 + 64 * 96)  # bytes of the FP8 experts
    scales = 4 * 8 * (6 * 2 + 2 * 3)  # (192, 64) in 6 x 2 blocks, (64, 96) in 2 x 3
    assert fp8_weight_bytes(fp8) == (weights + scales, 0)
    assert fp8_weight_bytes(dense) == (0, 2 * weights)


def test_fp8_experts_read_nothing_on_the_host(monkeypatch):
    """On FakeTensorMode's CUDA tensors (any host read raises): the routing, sort and
    combine around the FP8 kernel, so a decode step can be captured."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vllm.model_executor.layers import triton_fp8_gemm

    seen = []

    def launch(x, weight, scale, block, expert_ends):
        seen.append((expert_ends.device.type, block))
        return x.new_empty(x.shape[0], weight.shape[1])

    monkeypatch.setattr(triton_fp8_gemm, "fp8_grouped_linear", launch)
    from vllm.model_executor.layers.fused_moe import Activation

    with FakeTensorMode(), torch.device("cuda", 0):  # torch's gate: SiLU's is a Triton op
        fp8 = FusedMoE(8, 3, 64, 96, True, Activation("swigluoai"))
        fp8.use_fp8_weights((32, 32))
        out = fp8(torch.randn(4, 64), torch.randn(4, 8))
    assert out.shape == (4, 64) and out.device.type == "cuda"
    assert seen == [("cuda", (32, 32))] * 2
