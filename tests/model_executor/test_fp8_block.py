"""Block-scaled FP8 checkpoints kept in FP8 (``Fp8BlockLinear``, ``triton_fp8_gemm.py``):
tiny Llama, Qwen3-MoE, DeepSeek-V3 and Mixtral checkpoints in 32 x 32 and 64 x 64 blocks
(``fp8_checkpoints.py``), loaded with the kernel replaced by a float64 emulation and the
CUDA-only gate opened on the CPU, keep the checkpoint's bytes and block scales and give
the logits of transformers' model of the dequantized weights; the layers never exist dense
on the device, and the forward reads nothing on the host. The real kernel in a model,
under graph replay and in memory, is marked ``cuda``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.model_executor.fp8_checkpoints import write_fp8_checkpoint
from tests.model_executor.test_fp8 import IDS, hf_logits, save_model
from tests.tiny_models import load_cpu_runner, runner_logits
from tests.v1.worker.test_no_host_sync import HostSyncGuard
from vllm.config import ModelConfig
from vllm.model_executor.layers import triton_fp8_gemm
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.quantization import fp8_checkpoint
from vllm.model_executor.layers.quantization.fp8 import (
    FP8_DTYPE,
    Fp8BlockLinear,
    Fp8Linear,
    dequantize_model_fp8,
)


def emulated_fp8_block_linear(calls: list):
    """``fp8_block_linear`` in float64 from the FP8 bytes and block scales (written here,
    not the package's dequantization), output in ``x``'s dtype; records each call."""

    def kernel(x, weight, scale, block, bias=None, **tiles):
        n, k = weight.shape
        full = scale.double().repeat_interleave(block[0], 0)[:n]
        full = full.repeat_interleave(block[1], 1)[:, :k]
        y = x.double() @ (weight.double() * full).T
        if bias is not None:
            y = y + bias.double()
        calls.append((tuple(x.shape), tuple(weight.shape), tuple(block)))
        return y.to(x.dtype)

    return kernel


def emulated_fp8_grouped_linear(calls: list):
    """``fp8_grouped_linear`` in float64: each row through its expert's weight times its
    block (or row) scales; records (rows, weight shape, block) per call."""
    linear = emulated_fp8_block_linear([])

    def kernel(x, weight, scale, block, ends, **tiles):
        out = torch.zeros(x.shape[0], weight.shape[1], dtype=x.dtype)
        start = 0
        for e, end in enumerate(ends.tolist()):
            out[start:end] = linear(x[start:end], weight[e], scale[e], block or (1, x.shape[1]))
            start = end
        calls.append((x.shape[0], tuple(weight.shape), block))
        return out

    return kernel


@pytest.fixture
def module_path(monkeypatch) -> dict:
    """The CUDA-only gate opened on the CPU and the kernels emulated: the calls made."""
    calls: dict = {"linear": [], "grouped": []}
    monkeypatch.setattr(fp8_checkpoint, "block_fp8_supported", lambda device: (True, ""))
    linear = emulated_fp8_block_linear(calls["linear"])
    monkeypatch.setattr(triton_fp8_gemm, "fp8_block_linear", linear)
    grouped = emulated_fp8_grouped_linear(calls["grouped"])
    monkeypatch.setattr(triton_fp8_gemm, "fp8_grouped_linear", grouped)
    return calls


# Layers kept in FP8 per family and block: with 32 x 32 blocks every fused part ends on a
# block (q 64, k/v 32, gate/up 96 rows); with 64 x 64, k (32 rows) and gate (96) end inside
# one, so the fused q/k/v and gate/up are dequantized and only o_proj and the down
# projections stay FP8. DeepSeek-V3 a layer: q_a, q_b, kv_a_with_mqa, o, the dense or
# shared expert's down (and gate/up in 32 blocks); its kv_b_proj is split per head at load
# (dequantized). Routed experts (EXPERTS: MoE layers kept FP8) need the intermediate size
# (32 for Qwen3 and DeepSeek, 96 for Mixtral) in whole blocks: all in 32-row blocks, none
# in 64.
KEPT = {
    ("llama", 32): 8, ("llama", 64): 4,
    ("qwen3_moe", 32): 4, ("qwen3_moe", 64): 2,
    ("mixtral", 32): 4, ("mixtral", 64): 2,
    ("deepseek_v3", 32): 12, ("deepseek_v3", 64): 10,
}  # fmt: skip
EXPERTS = {"llama": 0, "qwen3_moe": 2, "mixtral": 2, "deepseek_v3": 1}


@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_block_fp8_checkpoint_keeps_its_bytes_and_the_dequantized_logits(
    family, block, tmp_path, module_path
):
    reference = write_fp8_checkpoint(save_model(family), tmp_path, "fp8_block", (block, block))
    runner = load_cpu_runner(
        ModelConfig(model=str(tmp_path), max_model_len=128, quantization="fp8")
    )
    layers = {n: m for n, m in runner.model.named_modules() if isinstance(m, Fp8Linear)}
    assert all(type(m) is Fp8BlockLinear for m in layers.values())
    assert len(layers) == KEPT[family, block], sorted(layers)
    assert not isinstance(runner.model.lm_head, Fp8Linear)
    sd = load_file(tmp_path / "model.safetensors")
    o_proj = layers.get("layers.0.o_proj") or layers["layers.0.self_attn.o_proj"]
    stored = "model.layers.0.self_attn.o_proj."
    assert torch.equal(o_proj.weight.view(torch.uint8), sd[stored + "weight"].view(torch.uint8))
    assert torch.equal(o_proj.weight_scale, sd[stored + "weight_scale_inv"])
    assert o_proj.block_size == (block, block)
    experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE) and m.fp8]
    assert len(experts) == (EXPERTS[family] if block == 32 else 0)
    for moe in experts:
        assert moe.w13_weight.dtype == FP8_DTYPE and moe.fp8_block == (block, block)
    ours = runner_logits(runner, IDS)
    # one call a layer for the prompt's forward; two a MoE layer kept FP8
    assert len(module_path["linear"]) == len(layers)
    assert len(module_path["grouped"]) == 2 * len(experts)
    ref = hf_logits(reference, IDS)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_fp8_experts_keep_the_checkpoints_bytes_and_scales(tmp_path, module_path):
    """Qwen3-MoE in 32 x 32 blocks: each expert's gate / up / down bytes and block scales in
    ``w13_weight`` / ``w2_weight`` as stored; --quantization fp32 dequantizes them (the
    exactness reference) to the same values as the FP8 layer's own dequantization."""
    write_fp8_checkpoint(save_model("qwen3_moe"), tmp_path, "fp8_block", (32, 32))
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), quantization="fp8"))
    sd = load_file(tmp_path / "model.safetensors")
    moe = runner.model.layers[1].mlp.experts
    for e in (0, 5, 7):
        p = f"model.layers.1.mlp.experts.{e}."
        names = ("gate_proj", "up_proj")
        stored = torch.cat([sd[p + n + ".weight"] for n in names])
        assert torch.equal(moe.w13_weight[e].view(torch.uint8), stored.view(torch.uint8))
        scales = torch.cat([sd[p + n + ".weight_scale_inv"] for n in names])
        assert torch.equal(moe.w13_scale[e], scales)
        assert torch.equal(moe.w2_scale[e], sd[p + "down_proj.weight_scale_inv"])
    dense = load_cpu_runner(ModelConfig(model=str(tmp_path), quantization="fp32"))
    twin = dense.model.layers[1].mlp.experts
    assert not twin.fp8 and not any(isinstance(m, Fp8Linear) for m in dense.model.modules())
    moe.dequantize_fp8_weights(torch.float32)
    assert torch.equal(twin.w13, moe.w13) and torch.equal(twin.w2, moe.w2)


def test_per_channel_fp8_experts_stay_fp8_with_row_scales(tmp_path, module_path):
    """A compressed-tensors per-channel checkpoint: the experts keep FP8 with one scale a
    row (weight-only in the kernel), and the layer equals its dequantized twin."""
    write_fp8_checkpoint(save_model("qwen3_moe"), tmp_path, "ct_channel_dynamic")
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), quantization="fp8"))
    sd = load_file(tmp_path / "model.safetensors")
    moe = runner.model.layers[0].mlp.experts
    assert moe.fp8 and moe.fp8_block is None and moe.w13_scale.shape == (8, 64, 1)
    down = "model.layers.0.mlp.experts.3.down_proj."
    assert torch.equal(moe.w2_weight[3].view(torch.uint8), sd[down + "weight"].view(torch.uint8))
    assert torch.equal(moe.w2_scale[3], sd[down + "weight_scale"])
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ours = moe(x, logits)
        moe.dequantize_fp8_weights(torch.float32)
        ref = moe(x, logits)
    assert module_path["grouped"] and torch.allclose(ours, ref, atol=1e-5)


def test_fused_parts_keep_their_block_scales_in_order(tmp_path, module_path):
    write_fp8_checkpoint(save_model("llama"), tmp_path, "fp8_block", (32, 32))
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), quantization="fp8"))
    sd = load_file(tmp_path / "model.safetensors")
    qkv = runner.model.layers[1].qkv_proj
    parts = [f"model.layers.1.self_attn.{n}_proj." for n in "qkv"]
    assert torch.equal(
        qkv.weight.view(torch.uint8), torch.cat([sd[p + "weight"] for p in parts]).view(torch.uint8)
    )
    assert torch.equal(qkv.weight_scale, torch.cat([sd[p + "weight_scale_inv"] for p in parts]))
    # fp32 serves the same layers dequantized: the exactness reference
    dense_runner = load_cpu_runner(ModelConfig(model=str(tmp_path), quantization="fp32"))
    assert torch.equal(
        dense_runner.model.layers[1].qkv_proj.weight, qkv.dequantized_weight(torch.float32)
    )


def test_without_the_kernel_block_fp8_is_dequantized_at_load(tmp_path):
    """On the CPU (the gate closed), the same checkpoint loads dense, and a block-scaled
    ``Fp8BlockLinear`` dequantizes exactly."""
    write_fp8_checkpoint(save_model("llama"), tmp_path, "fp8_block", (32, 32))
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path)))
    assert not any(isinstance(m, Fp8Linear) for m in runner.model.modules())
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(40, 48, generator=g) * 50).to(FP8_DTYPE)
    scale = torch.rand(2, 3, generator=g)
    model = torch.nn.Sequential(Fp8BlockLinear(weight, scale, (32, 16)))
    assert dequantize_model_fp8(model, torch.float32) == 1
    expected = weight.float() * scale.repeat_interleave(32, 0)[:40].repeat_interleave(16, 1)
    assert torch.equal(model[0].weight, expected)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_fp8_block_layers_never_exist_dense_on_the_device(
    family, tmp_path, module_path, monkeypatch
):
    """Loaded onto the meta device (standing in for a GPU) in bf16: the storage given to
    the model is its dense parameters in bf16 and the FP8 weights (linear layers and
    experts) with their block scales, never those weights dequantized."""
    from tests.model_executor.test_load_dtype import DeviceDtypes
    from vllm.model_executor.model_loader import get_model_config, load_model_weights
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.moe import MoeForCausalLM

    model_cls = LlamaForCausalLM if family == "llama" else MoeForCausalLM
    write_fp8_checkpoint(save_model(family), tmp_path, "fp8_block", (32, 32))
    recorder = DeviceDtypes("meta")
    plan = fp8_checkpoint.plan_fp8_linears

    def unrecorded_plan(*args):
        recorder.recording = False
        try:
            return plan(*args)
        finally:
            recorder.recording = True

    monkeypatch.setattr(fp8_checkpoint, "plan_fp8_linears", unrecorded_plan)
    with recorder:
        model = load_model_weights(
            model_cls, get_model_config(str(tmp_path)), str(tmp_path), "meta", torch.bfloat16
        )
    fp8 = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    experts = [m for m in model.modules() if isinstance(m, FusedMoE) and m.fp8]
    assert (len(fp8), len(experts)) == ((8, 0) if family == "llama" else (4, 2))
    allocated = {}
    for dtype, numel, op in recorder.outputs:
        if "empty_like" in op:
            allocated[dtype] = allocated.get(dtype, 0) + numel
    dense = [*model.parameters(), *(b for b in model.buffers() if b.dtype != FP8_DTYPE)]
    assert allocated[torch.bfloat16] == sum(t.numel() for t in dense if t.dtype == torch.bfloat16)
    fp8_tensors = [b for b in model.buffers() if b.dtype == FP8_DTYPE]
    assert allocated[FP8_DTYPE] == sum(t.numel() for t in fp8_tensors)
    assert allocated[torch.float32] == sum(t.numel() for t in dense if t.dtype == torch.float32)
    if family == "llama":  # a layer's blocks: q/k/v (128, 64) 4 x 2, o (64, 64) 2 x 2,
        # gate/up (192, 64) 6 x 2, down (64, 96) 2 x 3
        assert sum(m.weight_scale.numel() for m in fp8) == 2 * (4 * 2 + 2 * 2 + 6 * 2 + 2 * 3)
    else:  # 8 experts a layer: gate/up (64, 64) in 2 x 2 blocks, down (64, 32) in 2 x 1
        assert all(m.w13_scale.shape == (8, 2, 2) and m.w2_scale.shape == (8, 2, 1)
                   for m in experts)  # fmt: skip
        assert not any(p.dim() == 3 for p in model.parameters())  # no dense experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_linear_reads_nothing_on_the_host_and_keeps_its_dtypes(dtype, module_path):
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(48, 80, generator=g) * 20).to(FP8_DTYPE)
    layer = Fp8BlockLinear(weight, torch.rand(1, 3, generator=g), (64, 32), torch.randn(48))
    layer = layer.to(dtype)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == dtype
    x = torch.randn(3, 4, 80, generator=g).to(dtype)
    with torch.inference_mode(), HostSyncGuard():
        y = layer(x)
    assert y.shape == (3, 4, 48) and y.dtype == dtype
    assert module_path["linear"] == [((12, 80), (48, 80), (64, 32))]
    want = x.double() @ layer.dequantized_weight(torch.float64).T + layer.bias.double()
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert (y.double() - want).abs().max() <= tolerance * want.abs().max()


def test_fp8_block_linear_refuses_bad_blocks():
    weight = torch.zeros(48, 80, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="weight_scale of shape"):
        Fp8BlockLinear(weight, torch.ones(1, 2), (64, 32))
    with pytest.raises(ValueError, match="multiple of 16"):
        Fp8BlockLinear(weight, torch.ones(1, 10), (64, 8))
    with pytest.raises(NotImplementedError, match="weight-only"):
        Fp8BlockLinear(weight, torch.ones(1, 3), (64, 32)).quantize_input(torch.zeros(1, 80))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_block_fp8_llama_logits_graph_replay_and_memory(tmp_path):
    """The real kernel: a 32 x 32 block checkpoint on CUDA in bf16 keeps its 8 linear layers
    in FP8 (auto on an FP8 GPU, or forced), gives logits near the dequantized model's,
    replays a layer from a CUDA graph, and holds half the linear weights' bytes."""
    from vllm.model_executor.model_loader import (
        apply_quantization,
        get_model_config,
        load_model_weights,
    )
    from vllm.model_executor.models.llama import LlamaForCausalLM

    write_fp8_checkpoint(save_model("llama"), tmp_path, "fp8_block", (32, 32))
    config = get_model_config(str(tmp_path))
    load = LlamaForCausalLM, config, str(tmp_path), "cuda", torch.bfloat16
    model = load_model_weights(*load)
    fp8 = [m for m in model.modules() if isinstance(m, Fp8BlockLinear)]
    assert len(fp8) == 8 and all(m.weight.is_cuda for m in fp8)
    dense = load_model_weights(*load)
    apply_quantization(dense, ModelConfig(model=str(tmp_path), quantization="fp32"))
    layer, twin = model.layers[0].qkv_proj, dense.layers[0].qkv_proj
    x = torch.randn(9, 64, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        ours, ref = layer(x).float(), twin(x).float()
        assert (ours - ref).abs().max() <= 2e-2 * ref.abs().max()
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        layer(static_x)  # compiled before capture
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        new = torch.randn_like(x)
        static_x.copy_(new)
        graph.replay()
        assert torch.equal(static_y, layer(new))
    fp8_bytes = sum(m.weight.numel() + 4 * m.weight_scale.numel() for m in fp8)
    dense_bytes = sum(2 * m.weight.numel() for m in fp8)
    assert fp8_bytes < 0.6 * dense_bytes


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fp8_experts_near_dequantized_graph_replay_and_memory(tmp_path):
    """The real grouped kernel: a 32 x 32 block Qwen3-MoE on CUDA in bf16 keeps its experts
    in FP8, each MoE layer near its dequantized twin, replayed from a CUDA graph with
    other routings, at about half the experts' bytes."""
    from vllm.model_executor.model_loader import get_model_config, load_model_weights
    from vllm.model_executor.models.moe import MoeForCausalLM

    write_fp8_checkpoint(save_model("qwen3_moe"), tmp_path, "fp8_block", (32, 32))
    config = get_model_config(str(tmp_path))
    model = load_model_weights(MoeForCausalLM, config, str(tmp_path), "cuda", torch.bfloat16)
    moe = model.layers[0].mlp.experts
    assert moe.fp8 and moe.w13_weight.is_cuda and moe.w13_weight.dtype == FP8_DTYPE
    twin = FusedMoE(8, 2, 64, 32, True).to(torch.bfloat16).cuda()
    with torch.no_grad():
        dense = load_model_weights(MoeForCausalLM, config, str(tmp_path), "cuda", torch.bfloat16)
        dense.layers[0].mlp.experts.dequantize_fp8_weights(torch.bfloat16)
        twin.w13.copy_(dense.layers[0].mlp.experts.w13)
        twin.w2.copy_(dense.layers[0].mlp.experts.w2)
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(16, 8, device="cuda")
    with torch.inference_mode():
        ours, ref = moe(x, logits).float(), twin(x, logits).float()
        assert (ours - ref).abs().max() <= 2e-2 * ref.abs().max()
        static = (x.clone(), logits.clone())
        moe(*static)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(*static)
        new_x, new_logits = torch.randn_like(x), torch.randn_like(logits)
        static[0].copy_(new_x)
        static[1].copy_(new_logits)
        graph.replay()
        assert torch.equal(out, moe(new_x, new_logits))
    fp8_bytes = sum(t.numel() * t.element_size() for t in moe.buffers())
    assert fp8_bytes < 0.6 * sum(2 * t.numel() for t in (twin.w13, twin.w2))
