"""The Triton W4A16 GEMM (``layers/triton_w4a16.py``) and ``Int4Linear``
(``quantization/int4.py``): the kernel in Triton's interpreter on CPU against float64 (tiles
that do not divide the shapes, group sizes 16 / 32 / 128 / one group, partial last groups,
fp32 / bf16 / fp16), compiled to sm80/sm90 cubins without a GPU; ``Int4Linear`` repacked
from each checkpoint format (GPTQ act-order included) with the kernel replaced by a float64
emulation, with no host read in its forward; on CUDA (skipped here) the real kernel."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.model_executor.wna16_checkpoints import (
    SCHEMES,
    make_g_idx,
    quantize,
    store,
    write_wna16_checkpoint,
)
from tests.triton_interpreter import interpreted_cases, print_case_results
from vllm.model_executor.layers import triton_w4a16
from vllm.model_executor.layers.quantization import int4
from vllm.model_executor.layers.quantization.int4 import Int4Linear
from vllm.model_executor.layers.quantization.wna16_checkpoint import (
    WNA16CheckpointFormat,
    pop_quantized_weights,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CASES = {
    "fp32-g32-uneven": dict(m=5, k=96, n=70, group=32),
    "fp32-g128-partial-group": dict(m=3, k=200, n=33, group=128),
    "bf16-g16": dict(m=17, k=64, n=40, group=16, dtype="bfloat16"),
    "fp16-one-group": dict(m=2, k=136, n=24, group=136, dtype="float16"),
    "fp32-tiles-16": dict(m=20, k=48, n=20, group=32, block_m=16, block_n=16, block_k=16),
}
GPU_CASES = {  # Llama-3-70B's down projection at decode, groups of 128
    "bf16-70b-down-decode": dict(m=4, k=28672, n=8192, group=128, dtype="bfloat16"),
    "bf16-prefill": dict(m=300, k=4096, n=4104, group=128, dtype="bfloat16"),
}


def build_case(spec: dict, device: str) -> dict:
    g = torch.Generator().manual_seed(spec["k"] * 7 + spec["n"])
    k, n, group = spec["k"], spec["n"], spec["group"]
    groups = -(-k // group)
    q = torch.randint(0, 16, (k, n), generator=g)
    zeros = torch.randint(0, 17, (groups, n), generator=g)  # 16: GPTQ v1's unwrapped zero
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.001).half().float()
    x = torch.randn(spec["m"], k, generator=g).to(DTYPES[spec.get("dtype", "float32")])
    return dict(q=q, zeros=zeros, scales=scales, x=x.to(device),
                qweight=int4.pack_rows(q).to(device), scales_d=scales.to(device),
                zeros_d=zeros.to(torch.uint8).to(device))  # fmt: skip


def reference(t: dict, spec: dict) -> torch.Tensor:
    """float64 product with the weight rounded once to x's dtype, as the kernel does."""
    rows = torch.arange(spec["k"]) // spec["group"]
    w = (t["q"] - t["zeros"][rows]).double() * t["scales"][rows].double()
    return t["x"].cpu().double() @ w.to(t["x"].dtype).double()


def run_case(spec: dict, device: str) -> dict:
    t = build_case(spec, device)
    tiles = {k: spec[k] for k in ("block_m", "block_n", "block_k") if k in spec}
    y = triton_w4a16.w4a16_linear(t["x"], t["qweight"], t["scales_d"], t["zeros_d"],
                                  spec["group"], **tiles)  # fmt: skip
    ref = reference(t, spec)
    err = (y.cpu().double() - ref).abs().max().item()
    return {"err": err, "scale": ref.abs().max().item(), "dtype": str(y.dtype)}


def check_result(result: dict, spec: dict) -> None:
    assert "error" not in result, result["error"]
    dtype = spec.get("dtype", "float32")
    assert result["dtype"] == f"torch.{dtype}"
    # fp32: summation order only; 16-bit: the output's own rounding (8 / 11 mantissa bits)
    rel = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 1e-3}[dtype]
    assert result["err"] <= rel * result["scale"], result


def int4_layer_case() -> dict:
    """Int4Linear from a GPTQ act-order checkpoint in the interpreter, against the dense
    layer of the dequantized weight."""
    layer, dense, x = act_order_layer("gptq4_asym_act_order")
    y = layer(x)
    return {"err": (y - dense(x)).abs().max().item(), "scale": dense(x).abs().max().item()}


def interpreter_main() -> None:
    def run(case_id: str) -> dict:
        if case_id == "int4_layer":
            return int4_layer_case()
        return run_case(CASES[case_id], "cpu")

    print_case_results(type(triton_w4a16._w4a16_kernel).__name__, json.load(sys.stdin), run)


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_cases(__name__, [*CASES, "int4_layer"])


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_kernel_matches_float64(interpreted, case_id):
    check_result(interpreted[case_id], CASES[case_id])


def test_interpreted_int4_linear_equals_the_dequantized_layer(interpreted):
    result = interpreted["int4_layer"]
    assert "error" not in result, result.get("error")
    assert result["err"] <= 1e-5 * result["scale"], result


def act_order_layer(scheme: str, n_in: int = 96, out: int = 40, bias: bool = True):
    """(Int4Linear of one weight written as ``scheme``'s checkpoint, the dense layer of its
    dequantized weight, an input)."""
    cfg, (bits, group, asym, act_order) = SCHEMES[scheme]
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(out, n_in, generator=gen) * 0.05
    g_idx = make_g_idx(n_in, group, act_order, gen)
    q, zeros, scales = quantize(w, bits, group, asym, g_idx)
    state = {f"l.{leaf}": t for leaf, t in store(cfg["quant_method"], cfg, q, zeros, scales,
                                                 g_idx).items()}  # fmt: skip
    fmt = WNA16CheckpointFormat.from_config(cfg)
    qw = pop_quantized_weights(state, fmt)["l.weight"].read()
    b = torch.randn(out, generator=gen) if bias else None
    layer = Int4Linear.from_quantized(qw, fmt.group_size, b)
    dense = torch.nn.Linear(n_in, out, bias=bias)
    with torch.no_grad():
        dense.weight.copy_((q - zeros[:, g_idx]).float() * scales[:, g_idx].float())
        if bias:
            dense.bias.copy_(b)
    return layer, dense, torch.randn(3, 5, n_in, generator=gen)


def emulated_w4a16(x, qweight, scales, zeros, group_size, **tiles):
    """The kernel's contract in float64, unpacking the layout independently."""
    k = qweight.shape[0] * 8
    q = torch.stack([(qweight >> (4 * j)) & 15 for j in range(8)], dim=1).reshape(k, -1)
    g = torch.arange(k) // group_size
    w = ((q - zeros.long()[g]).double() * scales.double()[g]).to(x.dtype)
    return (x.double() @ w.double()).to(x.dtype)


def emulated_w4a16_grouped(x, qweight, scales, zeros, group_size, expert_ends, **tiles):
    """The grouped kernel's contract in float64, expert by expert (reads the ends on the
    host: the emulation only)."""
    out = torch.zeros(x.shape[0], qweight.shape[2], dtype=x.dtype)
    start = 0
    for e, end in enumerate(expert_ends.tolist()):
        out[start:end] = emulated_w4a16(x[start:end], qweight[e], scales[e], zeros[e], group_size)
        start = end
    return out


W4_SCHEMES = [s for s, (_, (bits, *_)) in SCHEMES.items() if bits == 4]


@pytest.mark.parametrize("scheme", W4_SCHEMES)
def test_int4_linear_from_each_format_equals_the_dequantized_layer(scheme, monkeypatch):
    monkeypatch.setattr(triton_w4a16, "w4a16_linear", emulated_w4a16)
    layer, dense, x = act_order_layer(scheme)
    assert (layer.perm is not None) == SCHEMES[scheme][1][3]
    with torch.no_grad():
        assert torch.allclose(layer(x), dense(x), atol=1e-6, rtol=1e-6)
        assert torch.equal(layer.dequantized_weight(torch.float32), dense.weight)


def test_int4_linear_forward_has_no_host_sync(monkeypatch):
    from tests.v1.worker.test_no_host_sync import HostSyncGuard

    monkeypatch.setattr(triton_w4a16, "w4a16_linear", lambda x, qw, *a: x @ x.new_zeros(
        x.shape[1], qw.shape[1]))  # fmt: skip
    layer, _, x = act_order_layer("gptq4_asym_act_order")
    with torch.inference_mode(), HostSyncGuard():
        assert layer(x).shape == (3, 5, 40)


def test_weights_the_kernel_cannot_take_are_not_repacked():
    layer, _, _ = act_order_layer("gptq8_channel_v2")
    assert layer is None  # 8-bit values
    _, dense, _ = act_order_layer("gptq4_sym_g32")
    with pytest.raises(ValueError, match="not a permutation of groups"):
        int4.act_order_permutation(torch.tensor([0, 1, 0, 1, 1, 1]), 2)
    assert int4.act_order_permutation(torch.tensor([0, 0, 1, 1]), 2) is None


def test_parts_in_different_input_orders_are_not_fused():
    a, _, _ = act_order_layer("gptq4_asym_act_order")
    cfg, (bits, group, asym, _) = SCHEMES["gptq4_asym_act_order"]
    qw = pop_quantized_weights(
        {f"l.{k}": v for k, v in store("gptq", cfg, *_quantized(bits, group, asym)).items()},
        WNA16CheckpointFormat.from_config(cfg),
    )["l.weight"].read()
    assert Int4Linear.from_parts([qw, qw], group) is not None
    other = pop_quantized_weights(
        {f"l.{k}": v for k, v in store("gptq", cfg, *_quantized(bits, group, asym, 1)).items()},
        WNA16CheckpointFormat.from_config(cfg),
    )["l.weight"].read()
    assert a is not None and Int4Linear.from_parts([qw, other], group) is None


def _quantized(bits, group, asym, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g_idx = make_g_idx(64, group, True, gen)
    return (*quantize(torch.randn(16, 64, generator=gen), bits, group, asym, g_idx), g_idx)


def test_bad_arguments_are_refused():
    t = build_case(CASES["fp32-g32-uneven"], "cpu")
    f = triton_w4a16.w4a16_linear
    with pytest.raises(ValueError, match="columns"):
        f(t["x"][:, :64], t["qweight"], t["scales_d"], t["zeros_d"], 32)
    with pytest.raises(ValueError, match="scales must be"):
        f(t["x"], t["qweight"], t["scales_d"][:1], t["zeros_d"], 32)
    with pytest.raises(ValueError, match="zeros must be"):
        f(t["x"], t["qweight"], t["scales_d"], t["zeros_d"].int(), 32)
    with pytest.raises(ValueError, match="tiles"):
        f(t["x"], t["qweight"], t["scales_d"], t["zeros_d"], 32, block_n=48)


def _compile(dtype: str, capability: int) -> None:
    kernel = triton_w4a16._w4a16_kernel if triton_w4a16.triton is not None else None
    if kernel is None:
        pytest.skip("triton is not installed")
    if not hasattr(kernel, "arg_names"):
        pytest.skip("TRITON_INTERPRET is set in this process")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(x_ptr="*" + dtype, qw_ptr="*i32", scales_ptr="*fp32", zeros_ptr="*u8",
                     out_ptr="*" + dtype, M="i32", N="i32", K="i32", group_size="i32",
                     stride_xm="i32", stride_xk="i32", stride_om="i32")  # fmt: skip
    constants = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, WIDEN=dtype == "fp32")
    signature.update((name, "constexpr") for name in constants)
    assert list(signature) == kernel.arg_names
    try:
        compiled = triton_w4a16.triton.compile(
            ASTSource(kernel, signature, constants), target=GPUTarget("cuda", capability, 32)
        )
    except RuntimeError as e:  # no ptxas in this install
        if "ptxas" in str(e):
            pytest.skip(str(e))
        raise
    assert compiled.asm["cubin"]


@pytest.mark.parametrize("dtype, capability", [("bf16", 90), ("fp16", 80), ("fp32", 80),
                                               ("bf16", 80)])  # fmt: skip
def test_kernel_compiles_to_cubins(dtype, capability):
    _compile(dtype, capability)


@pytest.mark.cuda
@pytest.mark.parametrize("case_id", list(CASES) + list(GPU_CASES))
def test_real_kernel_matches_float64(case_id):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = {**CASES, **GPU_CASES}[case_id]
    check_result(run_case(spec, "cuda"), spec)


@pytest.mark.cuda
def test_real_int4_linear_in_a_cuda_graph_equals_the_dequantized_layer():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    layer, dense, x = act_order_layer("gptq4_asym_act_order")
    layer, dense = layer.cuda(), dense.cuda().to(torch.bfloat16)
    x = x.cuda().to(torch.bfloat16)
    with torch.inference_mode():
        expected = dense(x)
        layer(x)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
        graph.replay()
        assert torch.allclose(y.float(), expected.float(), rtol=2e-2, atol=2e-2)


def _packed_where_the_kernel_runs(monkeypatch) -> None:
    """The CUDA path on the CPU: the kernel 'runs' here, as its float64 emulation."""
    monkeypatch.setattr(triton_w4a16, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(triton_w4a16, "w4a16_linear", emulated_w4a16)
    monkeypatch.setattr(triton_w4a16, "w4a16_grouped_linear", emulated_w4a16_grouped)


@pytest.mark.parametrize(
    "family, scheme, packed",
    [("llama", "awq_g32", 8), ("llama", "gptq4_asym_act_order", 8), ("llama", "ct_w4_g64_sym", 8),
     ("qwen3_moe", "gptq4_sym_g32", 4)],
)  # fmt: skip
def test_a_checkpoint_kept_packed_gives_the_dequantized_models_logits(
    family, scheme, packed, tmp_path, monkeypatch
):
    """Where the kernel runs, the loader plans Int4Linear layers (q/k/v and gate/up fused;
    routers and the head dense; the experts packed in FusedMoE): their logits equal the
    dequantized model's, and --quantization fp32 dequantizes them."""
    from tests.model_executor.wna16_checkpoints import IDS, hf_logits, save_model
    from tests.tiny_models import load_cpu_runner, runner_logits
    from vllm.config import ModelConfig

    _packed_where_the_kernel_runs(monkeypatch)
    ref = hf_logits(write_wna16_checkpoint(save_model(family), tmp_path, scheme), IDS)
    method = SCHEMES[scheme][0]["quant_method"]
    named = [(method, packed)] if method in ("awq", "gptq") else []
    for quantization, layers in [(None, packed), *named, ("fp32", 0)]:
        config = ModelConfig(model=str(tmp_path), max_model_len=128, quantization=quantization)
        runner = load_cpu_runner(config)
        found = [m for m in runner.model.modules() if isinstance(m, Int4Linear)]
        assert len(found) == layers
        if layers:
            # Int4Linear: the attention (64 inputs); the experts are packed in FusedMoE
            assert {m.in_features for m in found} == ({64} if family == "qwen3_moe" else {64, 96})
            assert all(m.scales.dtype == torch.float32 for m in found)
        ours = runner_logits(runner, IDS)
        assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_packed_layers_never_exist_dense(tmp_path, monkeypatch):
    """No linear weight of the decoder layers gets storage: only the packed buffers do."""
    from tests.model_executor.wna16_checkpoints import save_model
    from tests.tiny_models import load_cpu_runner
    from vllm.config import ModelConfig

    _packed_where_the_kernel_runs(monkeypatch)
    write_wna16_checkpoint(save_model("llama"), tmp_path, "awq_g32")
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    dense = [n for n, p in runner.model.named_parameters() if ".layers." in n and p.dim() == 2]
    assert dense == []
    assert all(m.weight.is_meta for m in runner.model.modules() if isinstance(m, Int4Linear))


@pytest.mark.cuda
@pytest.mark.parametrize("family, scheme", [("llama", "awq_g32"),
                                            ("qwen3_moe", "gptq4_asym_act_order")])  # fmt: skip
def test_real_packed_model_on_cuda_equals_the_dequantized_one(family, scheme, tmp_path):
    """On CUDA auto keeps the 4-bit layers packed: each one's output on bf16 inputs equals
    its dequantized twin's, and the engine's greedy tokens (fp32) equal ``generate``."""
    from tests.model_executor.wna16_checkpoints import save_model
    from tests.tiny_models import check_engine_greedy_matches
    from vllm.config import ModelConfig
    from vllm.model_executor.model_loader import (
        apply_quantization,
        get_model_config,
        load_model_weights,
    )
    from vllm.model_executor.models.registry import ModelRegistry

    if not torch.cuda.is_available() or triton_w4a16.triton is None:
        pytest.skip("needs a CUDA device and triton")
    write_wna16_checkpoint(save_model(family), tmp_path, scheme)
    config = get_model_config(str(tmp_path))
    model_cls, _ = ModelRegistry.resolve_model_cls(config)
    model = load_model_weights(model_cls, config, str(tmp_path), "cuda", torch.bfloat16)
    apply_quantization(model, ModelConfig(model=str(tmp_path)))
    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    assert layers and all(m.qweight.is_cuda for m in layers)
    for layer in layers:
        x = torch.randn(5, layer.in_features, device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            ours = layer(x).float()
            ref = layer.to_dense(torch.bfloat16)(x).float()
        assert torch.allclose(ours, ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())
    hf = save_model(family, vocab_size=49152, max_position_embeddings=256)
    reference = write_wna16_checkpoint(hf, tmp_path / "engine", scheme)
    check_engine_greedy_matches(reference, tmp_path / "engine", max_tokens=6)
