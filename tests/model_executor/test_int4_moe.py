"""4-bit MoE experts kept packed (``FusedMoE.use_int4_weights``, planned by
``int4.plan_int4_linears``): tiny Qwen3-MoE AWQ / GPTQ / compressed-tensors checkpoints
(``wna16_checkpoints.py``) loaded as on CUDA, the grouped kernel replaced by its float64
emulation, give the dequantized model's logits (1e-4) with no dense expert weight
allocated; GPTQ act-order experts stay dense; ``--quantization fp32`` dequantizes them. On
CUDA (skipped here) the real kernel: a packed MoE model against its dequantized twin, a
decode step replayed in a CUDA graph."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.model_executor.test_triton_w4a16 import emulated_w4a16, emulated_w4a16_grouped
from tests.model_executor.wna16_checkpoints import (
    IDS,
    hf_logits,
    save_model,
    write_wna16_checkpoint,
)
from tests.tiny_models import load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.layers import triton_w4a16
from vllm.model_executor.layers.fused_moe import INT4_BUFFERS, FusedMoE
from vllm.model_executor.layers.quantization.int4 import Int4Linear


def _packed_where_the_kernel_runs(monkeypatch) -> list[int]:
    """The CUDA path on the CPU: the kernels 'run' here, as their float64 emulations.
    Returns a list that grows by one per grouped-kernel call."""
    calls: list[int] = []

    def grouped(*args, **kwargs):
        calls.append(1)
        return emulated_w4a16_grouped(*args, **kwargs)

    monkeypatch.setattr(triton_w4a16, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(triton_w4a16, "w4a16_linear", emulated_w4a16)
    monkeypatch.setattr(triton_w4a16, "w4a16_grouped_linear", grouped)
    return calls


def _experts(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("scheme", ["awq_g32", "gptq4_sym_g32", "ct_w4_g64_sym",
                                    "ct_w4_channel_asym"])  # fmt: skip
def test_packed_experts_give_the_dequantized_models_logits(scheme, tmp_path, monkeypatch):
    calls = _packed_where_the_kernel_runs(monkeypatch)
    ref = hf_logits(write_wna16_checkpoint(save_model("qwen3_moe"), tmp_path, scheme), IDS)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    experts = _experts(runner.model)
    assert len(experts) == 2 and all(m.int4_group for m in experts)
    for moe in experts:
        assert moe.w13 is None and moe.w2 is None  # no dense expert weight allocated
        assert moe.w13_qweight.shape == (8, 64 // 8, 64) and moe.w2_qweight.shape == (8, 4, 64)
        assert moe.w13_scales.dtype == torch.float32 and moe.w2_zeros.dtype == torch.uint8
    dense = [n for n, p in runner.model.named_parameters() if "experts" in n]
    assert dense == []
    ours = runner_logits(runner, IDS)
    assert len(calls) == 4  # two grouped GEMMs in each of the two MoE layers
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_fp32_dequantizes_the_packed_experts(tmp_path, monkeypatch):
    calls = _packed_where_the_kernel_runs(monkeypatch)
    ref = hf_logits(write_wna16_checkpoint(save_model("qwen3_moe"), tmp_path, "awq_g32"), IDS)
    config = ModelConfig(model=str(tmp_path), max_model_len=128, quantization="fp32")
    runner = load_cpu_runner(config)
    assert not [m for m in runner.model.modules() if isinstance(m, Int4Linear)]
    for moe in _experts(runner.model):
        assert moe.int4_group is None and moe.w13.shape == (8, 64, 64)
        assert not any(hasattr(moe, n) for n in INT4_BUFFERS)
    ours = runner_logits(runner, IDS)
    assert calls == []
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_act_order_experts_stay_dense(tmp_path, monkeypatch):
    """GPTQ act-order: each expert's inputs in its own order, which the grouped kernel
    does not apply; the experts are dequantized, the attention still packed."""
    calls = _packed_where_the_kernel_runs(monkeypatch)
    scheme = "gptq4_asym_act_order"
    ref = hf_logits(write_wna16_checkpoint(save_model("qwen3_moe"), tmp_path, scheme), IDS)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert all(m.int4_group is None and m.w13 is not None for m in _experts(runner.model))
    assert [m for m in runner.model.modules() if isinstance(m, Int4Linear)]
    ours = runner_logits(runner, IDS)
    assert calls == []
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_dequantize_int4_weights_is_exact(tmp_path, monkeypatch):
    _packed_where_the_kernel_runs(monkeypatch)
    write_wna16_checkpoint(save_model("qwen3_moe"), tmp_path, "gptq4_sym_g32")
    from safetensors.torch import load_file

    dense = load_file(tmp_path / "dequantized" / "model.safetensors")
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    moe = _experts(runner.model)[1]
    moe.dequantize_int4_weights(torch.float32)
    p = "model.layers.1.mlp.experts.5."
    assert torch.equal(moe.w13[5, :32], dense[p + "gate_proj.weight"])
    assert torch.equal(moe.w13[5, 32:], dense[p + "up_proj.weight"])
    assert torch.equal(moe.w2[5], dense[p + "down_proj.weight"])


def test_int4_experts_keep_their_buffer_dtypes_and_refuse_what_they_cannot_hold():
    moe = FusedMoE(4, 2, 64, 32, renormalize=True)
    moe.use_int4_weights(32)
    assert moe.int4_group == (32, 32) and moe.w13_scales.shape == (4, 2, 64)
    moe.to(torch.bfloat16)
    assert moe.w13_scales.dtype == torch.float32 and moe.w2_qweight.dtype == torch.int32
    assert FusedMoE(4, 2, 64, 36, renormalize=True).int4_unsupported_reason() is not None
    with pytest.raises(ValueError, match="packed or biased"):
        moe.use_int4_weights(32)
    channel = FusedMoE(4, 2, 64, 32, renormalize=True)
    channel.use_int4_weights(-1)
    assert channel.int4_group == (64, 32) and channel.w2_scales.shape == (4, 1, 64)


@pytest.mark.cuda
@pytest.mark.parametrize("scheme", ["awq_g32", "ct_w4_channel_asym"])
def test_real_packed_moe_on_cuda_equals_its_dequantized_twin_in_a_cuda_graph(scheme, tmp_path):
    """On CUDA auto keeps the experts packed: each MoE layer, captured in a CUDA graph and
    replayed on new inputs, equals its dequantized twin (bf16)."""
    from vllm.model_executor.model_loader import get_model_config, load_model_weights
    from vllm.model_executor.models.registry import ModelRegistry

    if not torch.cuda.is_available() or triton_w4a16.triton is None:
        pytest.skip("needs a CUDA device and triton")
    write_wna16_checkpoint(save_model("qwen3_moe"), tmp_path, scheme)
    config = get_model_config(str(tmp_path))
    model_cls, _ = ModelRegistry.resolve_model_cls(config)
    model = load_model_weights(model_cls, config, str(tmp_path), "cuda", torch.bfloat16)
    experts = _experts(model)
    assert experts and all(m.int4_group and m.w13_qweight.is_cuda for m in experts)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for moe in experts:
        twin = copy.deepcopy(moe)
        twin.dequantize_int4_weights(torch.bfloat16)
        x = torch.randn(4, moe.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(4, moe.num_experts, device="cuda", generator=gen)
        with torch.inference_mode():
            moe(x, logits)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = moe(x, logits)
            x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
            logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen))
            graph.replay()
            ref = twin(x, logits).float()
        assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
