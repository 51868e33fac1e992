"""The Triton MXFP4 grouped GEMM (``layers/triton_mxfp4_moe.py``) against float64.

Cases: several experts with uneven groups, empty groups (first, middle, last), one expert
over many row tiles, rows past the last group (zeros), row tiles of 16 and 64 spanning up
to four experts, a group's last row first in a tile, N and K not multiples of the tiles
(K a multiple of 32, as MXFP4 is), (M, N, K) tiles of 16 x 16 x 32 and 32 x 32 x 256
besides the defaults, with and without bias, fp32/fp16/bf16 inputs, scales from 2^-27 to
2^13. On CPU the kernel runs in Triton's interpreter (a child process, as in
test_triton_prefill.py), and so do ``FusedMoE`` over packed experts and gpt-oss loading
an MXFP4 checkpoint packed (``keep_mxfp4_packed`` forced) against the same checkpoint
expanded; the real kernel on these cases and gpt-oss-20b-sized ones is marked ``cuda``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.triton_interpreter import compile_for_cuda, interpreted_cases, print_case_results
from vllm.model_executor.layers import triton_mxfp4_moe
from vllm.model_executor.models.gpt_oss import dequantize_mxfp4

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# Of each element's |x| @ |W|^T + |bias| (the size of its terms): fp32 sums in any order;
# fp16/bf16 also the output's rounding.
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}

CASES = {
    "fp32-uneven-bias": dict(counts=[5, 0, 19, 1], n=70, k=96, bias=True),
    "fp32-empty-ends": dict(counts=[0, 7, 0, 0, 9, 0], n=64, k=64),
    "fp32-one-expert-many-tiles": dict(counts=[50], n=20, k=32, bias=True),
    "fp32-rows-past-the-groups": dict(counts=[3, 4], n=16, k=64, extra_rows=6),
    "fp32-tile64-spans-experts": dict(
        counts=[40, 7, 0, 30, 2, 1], n=65, k=128, block_m=64, bias=True
    ),  # fmt: skip
    # a tile's first row the last of its expert (rows 16, 32 with tiles of 16)
    "fp32-a-group-ends-on-a-tile-start": dict(counts=[17, 16, 1], n=16, k=32, bias=True),
    "fp32-tiles-16x16-k32": dict(
        counts=[9, 0, 21], n=40, k=96, bias=True, tiles=dict(block_m=16, block_n=16, block_k=32)
    ),  # fmt: skip
    "bf16-tiles-32x32-k256": dict(
        counts=[30, 3, 11],
        n=70,
        k=288,
        bias=True,
        dtype="bfloat16",
        tiles=dict(block_m=32, block_n=32, block_k=256),
    ),  # fmt: skip
    "fp32-wide-scales": dict(counts=[6, 11], n=24, k=96, scales=(100, 140)),
    "bf16-bias": dict(counts=[3, 17, 0, 12], n=100, k=160, bias=True, dtype="bfloat16"),
    "bf16-decode-4-experts": dict(
        counts=[1, 0, 1, 1, 0, 1], n=130, k=64, dtype="bfloat16", bias=True
    ),  # fmt: skip
    "fp16-one-row-each": dict(counts=[1, 1, 1, 1], n=33, k=32, dtype="float16"),
    "fp16-no-rows": dict(counts=[0, 0, 0], n=16, k=32, dtype="float16"),
}
GPU_CASES = {  # gpt-oss-20b's projections: 32 experts, hidden 2880, intermediate 2880
    "bf16-gptoss20b-w13-decode": dict(
        counts=[1] * 4 + [0] * 28, n=5760, k=2880, dtype="bfloat16", bias=True, scales=(118, 124)
    ),  # fmt: skip
    "bf16-gptoss20b-w2-prefill": dict(
        counts=[97, 0, 300, 41] + [64] * 28,
        n=2880,
        k=2880,
        dtype="bfloat16",
        bias=True,
        scales=(118, 124),
    ),  # fmt: skip
}


def build_case(spec: dict, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    counts, n, k = spec["counts"], spec["n"], spec["k"]
    dtype = getattr(torch, spec.get("dtype", "float32"))
    lo, hi = spec.get("scales", (122, 130))
    shape = (len(counts), n, k // 32)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.uint8)
    rows = sum(counts) + spec.get("extra_rows", 0)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(len(counts), n, generator=gen) * 4 if spec.get("bias") else None
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(
        x=x.to(device, dtype),
        blocks=blocks.to(device),
        scales=scales.to(device),
        ends=ends.to(device),
        bias=None if bias is None else bias.to(device, dtype),
    )


def grouped_reference(x, blocks, scales, ends, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, size) float64: each row through its expert's expanded weights, and the sum of
    its terms' magnitudes (what the tolerance scales); rows past the groups are zeros."""
    w = dequantize_mxfp4(blocks.cpu(), scales.cpu(), torch.float64)
    x = x.cpu().double()
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    size = torch.zeros_like(out)
    start = 0
    for e, end in enumerate(ends.tolist()):
        b = 0.0 if bias is None else bias[e].cpu().double()
        out[start:end] = x[start:end] @ w[e].T + b
        size[start:end] = x[start:end].abs() @ w[e].abs().T + abs(b)
        start = end
    return out, size


def run_case(spec: dict, device: str, kernel=None) -> dict:
    t = build_case(spec, device)
    kernel = kernel or triton_mxfp4_moe.mxfp4_grouped_linear
    tiles = spec.get("tiles", {"block_m": spec["block_m"]} if "block_m" in spec else {})
    out = kernel(t["x"], t["blocks"], t["scales"], t["ends"], t["bias"], **tiles)
    ref, size = grouped_reference(t["x"], t["blocks"], t["scales"], t["ends"], t["bias"])
    out = out.cpu()
    excess = (out.double() - ref).abs() - TOLERANCE[spec.get("dtype", "float32")] * size
    return dict(
        dtype=str(out.dtype).removeprefix("torch."),
        shape=list(out.shape),
        worst_excess=float(excess.max()) if excess.numel() else 0.0,
        finite=bool(torch.isfinite(out).all()),
    )


def check_result(result: dict, spec: dict) -> None:
    assert "error" not in result, result.get("error")
    assert result["dtype"] == spec.get("dtype", "float32")
    assert result["shape"] == [sum(spec["counts"]) + spec.get("extra_rows", 0), spec["n"]]
    assert result["finite"]
    assert result["worst_excess"] <= 0, result


def fused_moe_case() -> dict:
    """``FusedMoE`` over packed experts (the swigluoai gate and biases between the kernel's
    two GEMMs) against the same layer with the experts expanded, fp32 and bf16."""
    from vllm.model_executor.layers.fused_moe import Activation, FusedMoE

    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(3)
        layers = [FusedMoE(6, 2, 64, 96, True, Activation("swigluoai"), True, mxfp4=m)
                  for m in (True, False)]  # fmt: skip
        packed, dense = (layer.to(dtype) for layer in layers)
        with torch.no_grad():
            for name in ("w13", "w2"):
                blocks = getattr(packed, name + "_blocks")
                blocks.copy_(torch.randint(0, 256, blocks.shape, generator=gen))
                scales = getattr(packed, name + "_scales")
                scales.copy_(torch.randint(124, 128, scales.shape, generator=gen))
                getattr(dense, name).copy_(dequantize_mxfp4(blocks, scales))
            for name in ("w13_bias", "w2_bias"):
                bias = torch.randn(getattr(packed, name).shape, generator=gen)
                getattr(packed, name).copy_(bias)
                getattr(dense, name).copy_(bias)
        x = torch.randn(9, 64, generator=gen).to(dtype)
        logits = torch.randn(9, 6, generator=gen)
        with torch.inference_mode():
            want = dense(x, logits).float()
            errors[str(dtype)] = float(((packed(x, logits).float() - want).abs()).max())
        errors[str(dtype) + "-scale"] = float(want.abs().max())
    return errors


def gpt_oss_case() -> dict:
    """gpt-oss built packed on the CPU (where the interpreter runs the kernel): an MXFP4
    checkpoint stays packed and each layer's experts equal the expanded model's; a
    checkpoint with bf16/fp32 experts (transformers' layout) is loaded dense; dummy
    weights give random codes at the dummy scale."""
    import tempfile
    from pathlib import Path

    from tests.model_executor.test_gpt_oss import save_mxfp4_checkpoint
    from vllm.model_executor.model_loader import load_model_weights
    from vllm.model_executor.models import gpt_oss

    with tempfile.TemporaryDirectory() as tmp:
        hf = save_mxfp4_checkpoint(Path(tmp))
        load = gpt_oss.GptOssForCausalLM, hf.config, tmp, "cpu", torch.float32
        dense = load_model_weights(*load)
        gpt_oss.keep_mxfp4_packed = lambda: True
        packed = load_model_weights(*load)
        dummy = load_model_weights(*load, load_format="dummy")
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)  # its experts are parameters: saved unquantized
        plain = load_model_weights(gpt_oss.GptOssForCausalLM, hf.config, tmp, "cpu", torch.float32)
    x = torch.randn(11, hf.config.hidden_size, generator=torch.Generator().manual_seed(4))
    result = {"packed": [], "max_err": 0.0}
    with torch.inference_mode():
        for ours, theirs in zip(packed.layers, dense.layers, strict=True):
            result["packed"].append(ours.mlp.experts.mxfp4)
            err = (ours.mlp(x) - theirs.mlp(x)).abs().max()
            result["max_err"] = max(result["max_err"], float(err))
        result["plain_packed"] = plain.layers[0].mlp.experts.mxfp4
        err = (plain.layers[0].mlp(x) - dense.layers[0].mlp(x)).abs().max()
        result["plain_err"] = float(err)
    experts = dummy.layers[0].mlp.experts
    result["dummy_packed"] = experts.mxfp4
    result["dummy_codes"] = int(experts.w13_blocks.unique().numel())
    result["dummy_scales"] = experts.w2_scales.unique().tolist()
    return result


EXTRA_CASES = {"fused_moe": fused_moe_case, "gpt_oss": gpt_oss_case}


def interpreter_main() -> None:
    def run(case_id: str) -> dict:
        if case_id in EXTRA_CASES:
            return EXTRA_CASES[case_id]()
        return run_case(CASES[case_id], "cpu")

    print_case_results(
        type(triton_mxfp4_moe._mxfp4_grouped_kernel).__name__, json.load(sys.stdin), run
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreted_cases(__name__, [*CASES, *EXTRA_CASES])


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_kernel_matches_float64(interpreted, case_id):
    check_result(interpreted[case_id], CASES[case_id])


def test_interpreted_fused_moe_over_packed_experts_equals_the_expanded_layer(interpreted):
    result = interpreted["fused_moe"]
    assert "error" not in result, result.get("error")
    assert result["torch.float32"] <= 1e-5 * result["torch.float32-scale"], result
    # bf16: h is rounded to bf16 before the gate on both paths, the products differ in order
    assert result["torch.bfloat16"] <= 2e-2 * result["torch.bfloat16-scale"], result


def test_interpreted_gpt_oss_keeps_an_mxfp4_checkpoint_packed(interpreted):
    from vllm.model_executor.models.gpt_oss import DUMMY_MXFP4_SCALE

    result = interpreted["gpt_oss"]
    assert "error" not in result, result.get("error")
    assert result["packed"] == [True, True]
    assert result["max_err"] <= 1e-4, result
    assert not result["plain_packed"] and result["plain_err"] <= 1e-5, result
    assert result["dummy_packed"] and result["dummy_codes"] > 200
    assert result["dummy_scales"] == [DUMMY_MXFP4_SCALE]


def test_the_checks_catch_a_wrong_kernel():
    # Emulated kernels (no Triton): a right one passes; one that swaps the nibbles, one
    # off by one in the scale's bias, one without the bias, one that gives the first row
    # of each group the previous expert, and one that rounds fp32 to bf16 fail.
    def emulated(mistake):
        def kernel(x, blocks, scales, ends, bias=None, **tiles):
            if mistake == "nibbles":
                blocks = (blocks << 4) | (blocks >> 4)
            if mistake == "scale":
                scales = scales + 1
            if mistake == "bias":
                bias = None
            if mistake == "boundary":
                ends = ends + 1
            out, _ = grouped_reference(x, blocks, scales, ends, bias)
            if mistake == "rounding":
                out = out.to(torch.bfloat16)
            return out.to(x.dtype)

        return kernel

    spec, bf16 = CASES["fp32-uneven-bias"], CASES["bf16-bias"]
    check_result(run_case(spec, "cpu", emulated(None)), spec)
    check_result(run_case(bf16, "cpu", emulated(None)), bf16)
    for mistake in ("nibbles", "scale", "bias", "boundary", "rounding"):
        with pytest.raises(AssertionError):
            check_result(run_case(spec, "cpu", emulated(mistake)), spec)


def test_arguments_are_checked_before_any_launch():
    t = build_case(CASES["fp32-uneven-bias"], "cpu")
    x, blocks, scales, ends, bias = t["x"], t["blocks"], t["scales"], t["ends"], t["bias"]
    f = triton_mxfp4_moe.mxfp4_grouped_linear
    with pytest.raises(ValueError, match="columns"):
        f(x[:, :64], blocks, scales, ends, bias)
    with pytest.raises(ValueError, match="expert_ends"):
        f(x, blocks, scales, ends.long(), bias)
    with pytest.raises(ValueError, match="bias"):
        f(x, blocks, scales, ends, bias[:, :-1])
    with pytest.raises(ValueError, match="scales"):
        f(x, blocks, scales[:, :-1], ends, bias)
    with pytest.raises(ValueError, match="uint8"):
        f(x, blocks.int(), scales, ends, bias)
    with pytest.raises(ValueError, match="x must be"):
        f(x.long(), blocks, scales, ends, bias)
    with pytest.raises(ValueError, match="block_k=48"):
        f(x, blocks, scales, ends, bias, block_k=48)
    with pytest.raises(ValueError, match="block_n=8"):
        f(x, blocks, scales, ends, bias, block_n=8)
    if triton_mxfp4_moe.triton is not None:  # this process is not interpreted: refused
        with pytest.raises(RuntimeError, match="runs on CUDA"):
            f(x, blocks, scales, ends, bias)


@pytest.mark.parametrize(
    "dtype, precision, has_bias, tiles, capability",
    [("bf16", "tf32", True, (16, 64, 64), 90), ("fp32", "ieee", False, (64, 64, 64), 80),
     ("bf16", "tf32", True, (32, 32, 256), 90)],
)  # fmt: skip
def test_the_kernel_compiles_for_cuda_without_a_gpu(dtype, precision, has_bias, tiles, capability):
    """What the interpreter does not check: the kernel lowers to a cubin (Hopper and
    Ampere), with Triton's CUDA backend and its ptxas."""
    if triton_mxfp4_moe.triton is None:
        pytest.skip("triton is not installed")
    kernel = triton_mxfp4_moe._mxfp4_grouped_kernel
    pointers = dict(x_ptr=dtype, blocks_ptr="u8", scales_ptr="u8", ends_ptr="i32",
                    bias_ptr=dtype, out_ptr=dtype)  # fmt: skip
    blocks = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), tiles, strict=True), BLOCK_E=32)
    constants = dict(**blocks, HAS_BIAS=has_bias, PRECISION=precision)
    scalars = {name: "i32" for name in kernel.arg_names[6:13]}
    compile_for_cuda(kernel, pointers, scalars, constants, capability)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", list(CASES) + list(GPU_CASES))
def test_real_kernel_matches_float64(case_id):
    spec = {**CASES, **GPU_CASES}[case_id]
    check_result(run_case(spec, "cuda"), spec)
