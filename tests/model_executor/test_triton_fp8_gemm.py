"""The Triton block-scaled FP8 GEMM (``layers/triton_fp8_gemm.py``) against float64.

Cases: every e4m3fn byte but the NaNs (subnormals, both zeros, +-448), N and K not
multiples of the tiles nor of the scale blocks (partial blocks on both edges), blocks of
128 x 128 (the checkpoints'), 64 x 64 and 48 x 32 (a K step of 16), one row and many row
tiles, tiles of 16 x 16 x 16 and 64 x 128 x 128, with and without bias, fp32 / fp16 / bf16
inputs, scales from 2^-20 to 2^4. On CPU the kernel runs in Triton's interpreter (a child
process, as in test_triton_prefill.py), and so does ``Fp8BlockLinear`` over it; it is
compiled to sm80 / sm90 cubins here; the real kernel on these cases and Qwen3-sized ones
is marked ``cuda``.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.triton_interpreter import compile_for_cuda, interpreted_cases, print_case_results
from vllm.model_executor.layers import triton_fp8_gemm

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# Of each element's |x| @ |W|^T + |bias| (the size of its terms): fp32 sums in any order;
# fp16/bf16 also the output's rounding.
TOLERANCE = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}

CASES = {
    "fp32-all-bytes-bias": dict(m=5, n=70, k=256, block=(64, 64), bias=True, all_bytes=True),
    "fp32-partial-blocks": dict(m=19, n=100, k=200, block=(64, 64), bias=True),
    "fp32-blocks-128": dict(m=3, n=130, k=300, block=(128, 128)),
    "fp32-blocks-48x32-k16": dict(
        m=33, n=50, k=90, block=(48, 32), tiles=dict(block_m=16, block_n=16, block_k=16)
    ),  # fmt: skip
    "fp32-wide-scales": dict(m=7, n=64, k=128, block=(32, 64), scales=(-20, 4)),
    "bf16-tiles-64x128-k128": dict(
        m=70,
        n=200,
        k=384,
        block=(128, 128),
        dtype="bfloat16",
        bias=True,
        tiles=dict(block_m=64, block_n=128, block_k=128),
    ),  # fmt: skip
    "bf16-one-row": dict(m=1, n=96, k=160, block=(64, 64), dtype="bfloat16"),
    "fp16-bias": dict(m=9, n=33, k=64, block=(16, 32), dtype="float16", bias=True),
    "fp16-no-rows": dict(m=0, n=16, k=64, block=(64, 64), dtype="float16"),
}
GPU_CASES = {  # Qwen3-30B-A3B-FP8's attention: hidden 2048, q 4096 / kv 512 a head group
    "bf16-qwen3-qkv-decode": dict(m=1, n=5120, k=2048, block=(128, 128), dtype="bfloat16"),
    "bf16-qwen3-o-prefill": dict(m=1000, n=2048, k=4096, block=(128, 128), dtype="bfloat16"),
    "fp16-decode-batch": dict(m=64, n=4096, k=4096, block=(128, 128), dtype="float16"),
}


def random_fp8(shape, gen: torch.Generator, all_bytes: bool = False) -> torch.Tensor:
    """FP8 weights from random bytes (every finite e4m3fn value), NaN codes redrawn as 0."""
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    if all_bytes:  # each of the 254 finite codes at least once
        finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        b.view(-1)[: finite.numel()] = finite
    b[(b & 0x7F) == 0x7F] = 0
    return b.view(torch.float8_e4m3fn)


def build_case(spec: dict, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    m, n, k, (b0, b1) = spec["m"], spec["n"], spec["k"], spec["block"]
    dtype = getattr(torch, spec.get("dtype", "float32"))
    weight = random_fp8((n, k), gen, spec.get("all_bytes", False))
    lo, hi = spec.get("scales", (-10, -6))
    exps = torch.randint(lo, hi + 1, (-(-n // b0), -(-k // b1)), generator=gen)
    scale = torch.rand(exps.shape, generator=gen).add(1.0) * torch.exp2(exps.float())
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if spec.get("bias") else None
    return dict(
        x=x.to(device, dtype),
        weight=weight.to(device),
        scale=scale.to(device),
        block=(b0, b1),
        bias=None if bias is None else bias.to(device, dtype),
    )


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float64 ``weight * scale`` per block (written here independently of the package)."""
    n, k = weight.shape
    full = scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)
    return weight.double() * full[:, :k]


def reference(x, weight, scale, block, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, size) float64: the product and the sum of its terms' magnitudes."""
    w = dequantize(weight.cpu(), scale.cpu(), block)
    x = x.cpu().double()
    b = 0.0 if bias is None else bias.cpu().double()
    return x @ w.T + b, x.abs() @ w.abs().T + (0.0 if bias is None else b.abs())


def run_case(spec: dict, device: str, kernel=None) -> dict:
    t = build_case(spec, device)
    kernel = kernel or triton_fp8_gemm.fp8_block_linear
    out = kernel(t["x"], t["weight"], t["scale"], t["block"], t["bias"], **spec.get("tiles", {}))
    ref, size = reference(t["x"], t["weight"], t["scale"], t["block"], t["bias"])
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
    assert result["shape"] == [spec["m"], spec["n"]]
    assert result["finite"]
    assert result["worst_excess"] <= 0, result


# The grouped GEMM over stacked experts (rows sorted by expert): uneven and empty groups
# (first, middle, last), one expert over many tiles, rows past the groups, tiles of 16 and
# 64 spanning several experts, a group ending on a tile's first row, block and per-row
# scales, N and K off the tiles and the blocks.
GROUPED_CASES = {
    "g-fp32-uneven-blocks": dict(counts=[5, 0, 19, 1], n=70, k=96, block=(32, 32)),
    "g-fp32-empty-ends-rows": dict(counts=[0, 7, 0, 0, 9, 0], n=64, k=80, block=None),
    "g-fp32-one-expert-many-tiles": dict(counts=[50], n=20, k=64, block=(16, 64)),
    "g-fp32-rows-past-the-groups": dict(counts=[3, 4], n=16, k=64, block=(64, 64), extra_rows=6),
    "g-fp32-tile64-spans-experts": dict(
        counts=[40, 7, 0, 30, 2, 1], n=65, k=128, block=(128, 128), tiles=dict(block_m=64)
    ),
    "g-fp32-a-group-ends-on-a-tile-start": dict(counts=[17, 16, 1], n=16, k=32, block=None),
    "g-bf16-blocks-tiles-16x16x16": dict(
        counts=[9, 0, 21],
        n=40,
        k=96,
        block=(48, 32),
        dtype="bfloat16",
        tiles=dict(block_m=16, block_n=16, block_k=16),
    ),  # fmt: skip
    "g-fp16-rows-decode": dict(counts=[1, 0, 1, 1, 0, 1], n=130, k=70, block=None, dtype="float16"),
    "g-bf16-no-rows": dict(counts=[0, 0, 0], n=16, k=32, block=(32, 32), dtype="bfloat16"),
}
GPU_GROUPED_CASES = {  # Qwen3-30B-A3B-FP8's experts: 128, hidden 2048, intermediate 768
    "g-bf16-qwen3-w13-decode": dict(
        counts=[1] * 8 + [0] * 120, n=1536, k=2048, block=(128, 128), dtype="bfloat16"
    ),
    "g-bf16-qwen3-w2-prefill": dict(
        counts=[97, 0, 300, 41] + [64] * 124, n=2048, k=768, block=(128, 128), dtype="bfloat16"
    ),
}


def build_grouped_case(spec: dict, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    counts, n, k, block = spec["counts"], spec["n"], spec["k"], spec["block"]
    dtype = getattr(torch, spec.get("dtype", "float32"))
    weight = random_fp8((len(counts), n, k), gen)
    shape = (
        (len(counts), n, 1)
        if block is None
        else (len(counts), -(-n // block[0]), -(-k // block[1]))
    )
    scale = torch.rand(shape, generator=gen).add(1.0) * torch.exp2(
        torch.randint(-10, -5, shape, generator=gen).float()
    )
    x = torch.randn(sum(counts) + spec.get("extra_rows", 0), k, generator=gen)
    ends = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(x=x.to(device, dtype), weight=weight.to(device), scale=scale.to(device),
                block=block, ends=ends.to(device))  # fmt: skip


def grouped_reference(x, weight, scale, block, ends) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, size) float64: each row through its expert's dequantized weight (rows past
    the groups: zeros), and the sum of its terms' magnitudes."""
    x = x.cpu().double()
    out = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float64)
    size = torch.zeros_like(out)
    start = 0
    for e, end in enumerate(ends.tolist()):
        s = scale[e].cpu()
        w = dequantize(weight[e].cpu(), s, block or (1, weight.shape[2]))
        out[start:end] = x[start:end] @ w.T
        size[start:end] = x[start:end].abs() @ w.abs().T
        start = end
    return out, size


def run_grouped_case(spec: dict, device: str, kernel=None) -> dict:
    t = build_grouped_case(spec, device)
    kernel = kernel or triton_fp8_gemm.fp8_grouped_linear
    args = t["x"], t["weight"], t["scale"], t["block"], t["ends"]
    out = kernel(*args, **spec.get("tiles", {})).cpu()
    ref, size = grouped_reference(*args)
    excess = (out.double() - ref).abs() - TOLERANCE[spec.get("dtype", "float32")] * size
    return dict(
        dtype=str(out.dtype).removeprefix("torch."),
        shape=list(out.shape),
        worst_excess=float(excess.max()) if excess.numel() else 0.0,
        finite=bool(torch.isfinite(out).all()),
    )


def check_grouped_result(result: dict, spec: dict) -> None:
    check_result(result, dict(spec, m=sum(spec["counts"]) + spec.get("extra_rows", 0)))


def linear_case() -> dict:
    """``Fp8BlockLinear`` (the kernel) against the ``nn.Linear`` of its dequantized weight,
    fp32 and bf16, 3-d input."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8BlockLinear

    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        t = build_case(dict(m=0, n=80, k=96, block=(64, 64), bias=True), "cpu")
        layer = Fp8BlockLinear(t["weight"], t["scale"], (64, 64), t["bias"]).to(dtype)
        dense = layer.to_dense(torch.float64)
        x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
        with torch.inference_mode():
            y = layer(x)
            want = dense(x.double())
        result[str(dtype)] = float((y.double() - want).abs().max() / want.abs().max())
        result[str(dtype) + "-dtype"] = str(y.dtype)
    return result


def fused_moe_case() -> dict:
    """``FusedMoE`` over FP8 experts (block and per-row scales; SiLU between the kernel's
    two GEMMs) against the same layer dequantized, fp32 and bf16."""
    from tests.model_executor.test_moe import fp8_experts

    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        for block in ((32, 32), None):
            fp8, dense, x, logits = fp8_experts(9, dtype, block, seed=3)
            with torch.inference_mode():
                want = dense(x, logits).float()
                err = (fp8(x, logits).float() - want).abs().max() / want.abs().max()
            errors[f"{dtype}-{block}"] = float(err)
    return errors


def model_case() -> dict:
    """A tiny Qwen3-MoE checkpoint in 32 x 32 blocks loaded with the CUDA-only gate opened
    (both kernels interpreted: its linear layers and experts kept FP8) against the same
    checkpoint dequantized (``--quantization fp32``): fp32 logits."""
    import tempfile
    from pathlib import Path

    from tests.model_executor.fp8_checkpoints import write_fp8_checkpoint
    from tests.model_executor.test_fp8 import IDS, save_model
    from tests.tiny_models import load_cpu_runner, runner_logits
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.layers.quantization import fp8_checkpoint
    from vllm.model_executor.layers.quantization.fp8 import Fp8BlockLinear

    fp8_checkpoint.block_fp8_supported = lambda device: (True, "")
    with tempfile.TemporaryDirectory() as tmp:
        write_fp8_checkpoint(save_model("qwen3_moe"), Path(tmp), "fp8_block", (32, 32))
        runs = {q: load_cpu_runner(ModelConfig(model=tmp, max_model_len=128, quantization=q))
                for q in ("fp8", "fp32")}  # fmt: skip
    model = runs["fp8"].model
    logits = {q: runner_logits(r, IDS) for q, r in runs.items()}
    return dict(
        linear=sum(isinstance(m, Fp8BlockLinear) for m in model.modules()),
        experts=sum(isinstance(m, FusedMoE) and m.fp8 for m in model.modules()),
        err=float((logits["fp8"] - logits["fp32"]).abs().max()),
        scale=float(logits["fp32"].abs().max()),
    )


EXTRA_CASES = {"linear": linear_case, "fused_moe": fused_moe_case, "model": model_case}


def interpreter_main() -> None:
    def run(case_id: str) -> dict:
        if case_id in EXTRA_CASES:
            return EXTRA_CASES[case_id]()
        if case_id in GROUPED_CASES:
            return run_grouped_case(GROUPED_CASES[case_id], "cpu")
        return run_case(CASES[case_id], "cpu")

    print_case_results(
        type(triton_fp8_gemm._fp8_block_gemm_kernel).__name__, json.load(sys.stdin), run
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreted_cases(__name__, [*CASES, *GROUPED_CASES, *EXTRA_CASES])


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_kernel_matches_float64(interpreted, case_id):
    check_result(interpreted[case_id], CASES[case_id])


@pytest.mark.parametrize("case_id", list(GROUPED_CASES))
def test_interpreted_grouped_kernel_matches_float64(interpreted, case_id):
    check_grouped_result(interpreted[case_id], GROUPED_CASES[case_id])


def test_the_grouped_checks_catch_a_wrong_kernel():
    # A right emulation passes; one giving each group's first row the previous expert, one
    # using expert 0's scales for all, one reading per-row scales of the wrong expert fail.
    def emulated(mistake):
        def kernel(x, weight, scale, block, ends, **tiles):
            if mistake == "boundary":
                ends = ends + 1
            if mistake == "scales":
                scale = scale[:1].expand(scale.shape).contiguous()
            if mistake == "experts":
                scale = scale.roll(1, dims=0)
            out, _ = grouped_reference(x, weight, scale, block, ends)
            return out.to(x.dtype)

        return kernel

    for case_id in ("g-fp32-uneven-blocks", "g-fp32-empty-ends-rows"):
        spec = GROUPED_CASES[case_id]
        check_grouped_result(run_grouped_case(spec, "cpu", emulated(None)), spec)
        for mistake in ("boundary", "scales", "experts"):
            with pytest.raises(AssertionError):
                check_grouped_result(run_grouped_case(spec, "cpu", emulated(mistake)), spec)


def test_grouped_arguments_are_checked_before_any_launch():
    t = build_grouped_case(GROUPED_CASES["g-fp32-uneven-blocks"], "cpu")
    x, w, s, block, ends = t["x"], t["weight"], t["scale"], t["block"], t["ends"]
    f = triton_fp8_gemm.fp8_grouped_linear
    with pytest.raises(ValueError, match="columns"):
        f(x[:, :64].contiguous(), w, s, block, ends)
    with pytest.raises(ValueError, match="scale must be"):
        f(x, w, s, None, ends)  # block scales read as per row
    with pytest.raises(ValueError, match="expert_ends"):
        f(x, w, s, block, ends.long())
    with pytest.raises(ValueError, match="weight must be"):
        f(x, w[0], s, block, ends)
    with pytest.raises(ValueError, match="block_k=64"):
        f(x, w, s, block, ends, block_k=64)  # the blocks are 32 wide
    if triton_fp8_gemm.triton is not None:  # this process is not interpreted: refused
        with pytest.raises(RuntimeError, match="runs on CUDA"):
            f(x, w, s, block, ends)


def test_interpreted_fp8_block_linear_equals_its_dequantized_linear(interpreted):
    result = interpreted["linear"]
    assert "error" not in result, result.get("error")
    assert result["torch.float32"] <= 1e-6, result
    assert result["torch.bfloat16"] <= 8e-3, result
    assert result["torch.bfloat16-dtype"] == "torch.bfloat16"


def test_interpreted_fused_moe_over_fp8_experts_equals_the_dequantized_layer(interpreted):
    result = interpreted["fused_moe"]
    assert "error" not in result, result.get("error")
    for key, err in result.items():
        # bf16: h is rounded to bf16 before the gate on both paths, products in other orders
        assert err <= (1e-5 if "float32" in key else 2e-2), (key, err)
    assert len(result) == 4


def test_interpreted_block_fp8_qwen3_moe_gives_the_dequantized_logits(interpreted):
    result = interpreted["model"]
    assert "error" not in result, result.get("error")
    assert (result["linear"], result["experts"]) == (4, 2), result
    assert result["err"] <= 1e-4 and result["scale"] > 0.1, result


def test_the_checks_catch_a_wrong_kernel():
    # Emulated kernels (no Triton): a right one passes; one using each column's first
    # scale block for all of K, one shifted by one block column, one reading e4m3fn as
    # e5m2, one without the bias and one rounding fp32 to bf16 fail.
    def emulated(mistake):
        def kernel(x, weight, scale, block, bias=None, **tiles):
            if mistake == "first-k-block":  # the scale of a column's first block only
                scale = scale[:, :1].expand(scale.shape).contiguous()
            if mistake == "shifted":
                scale = scale.roll(1, dims=1)
            if mistake == "e5m2":
                weight = weight.view(torch.uint8).view(torch.float8_e5m2).float()
                weight = weight.nan_to_num(0.0, 0.0, 0.0).clamp(-448, 448).to(torch.float8_e4m3fn)
            if mistake == "bias":
                bias = None
            out, _ = reference(x, weight, scale, block, bias)
            if mistake == "rounding":
                out = out.to(torch.bfloat16)
            return out.to(x.dtype)

        return kernel

    spec, bf16 = CASES["fp32-partial-blocks"], CASES["bf16-one-row"]
    check_result(run_case(spec, "cpu", emulated(None)), spec)
    check_result(run_case(bf16, "cpu", emulated(None)), bf16)
    for mistake in ("first-k-block", "shifted", "e5m2", "bias", "rounding"):
        with pytest.raises(AssertionError):
            check_result(run_case(spec, "cpu", emulated(mistake)), spec)


def test_arguments_are_checked_before_any_launch():
    t = build_case(CASES["fp32-partial-blocks"], "cpu")
    x, w, s, block, bias = t["x"], t["weight"], t["scale"], t["block"], t["bias"]
    f = triton_fp8_gemm.fp8_block_linear
    with pytest.raises(ValueError, match="columns"):
        f(x[:, :64], w, s, block, bias)
    with pytest.raises(ValueError, match="scale must be"):
        f(x, w, s[:, :-1].contiguous(), block, bias)
    with pytest.raises(ValueError, match="scale must be"):
        f(x, w, s, (128, 128), bias)
    with pytest.raises(ValueError, match="bias"):
        f(x, w, s, block, bias[:-1])
    with pytest.raises(ValueError, match="weight must be"):
        f(x, w.float(), s, block, bias)
    with pytest.raises(ValueError, match="x must be"):
        f(x.long(), w, s, block, bias)
    with pytest.raises(ValueError, match="contiguous"):
        f(x.t().contiguous().t(), w, s, block, bias)
    with pytest.raises(ValueError, match="block_k=128"):
        f(x, w, s, block, bias, block_k=128)  # the blocks are 64 wide
    with pytest.raises(ValueError, match="block_n=8"):
        f(x, w, s, block, bias, block_n=8)
    assert triton_fp8_gemm.default_block_k((128, 128)) == 128
    assert triton_fp8_gemm.default_block_k((48, 48)) == 16
    assert triton_fp8_gemm.default_block_k((64, 8)) is None
    if triton_fp8_gemm.triton is not None:  # this process is not interpreted: refused
        with pytest.raises(RuntimeError, match="runs on CUDA"):
            f(x, w, s, block, bias)


@pytest.mark.parametrize(
    "dtype, widen, has_bias, tiles, block, capability",
    [("bf16", False, True, (16, 64, 128), (128, 128), 90),
     ("fp16", False, False, (64, 128, 128), (128, 128), 80),
     ("bf16", False, False, (16, 16, 16), (48, 32), 80),
     ("fp32", True, True, (64, 64, 64), (64, 64), 90)],
)  # fmt: skip
def test_the_kernel_compiles_for_cuda_without_a_gpu(dtype, widen, has_bias, tiles, block,
                                                     capability):  # fmt: skip
    """What the interpreter does not check: the kernel lowers to a cubin (Hopper and
    Ampere), 16-bit products included (the interpreter widens them), with Triton's CUDA
    backend and its ptxas."""
    if triton_fp8_gemm.triton is None:
        pytest.skip("triton is not installed")
    kernel = triton_fp8_gemm._fp8_block_gemm_kernel
    pointers = dict(x_ptr=dtype, w_ptr="u8", scale_ptr="fp32", bias_ptr=dtype, out_ptr=dtype)
    constants = dict(B0=block[0], B1=block[1], BLOCK_M=tiles[0], BLOCK_N=tiles[1],
                     BLOCK_K=tiles[2], HAS_BIAS=has_bias, WIDEN=widen)  # fmt: skip
    scalars = {name: "i32" for name in kernel.arg_names[5:10]}
    compile_for_cuda(kernel, pointers, scalars, constants, capability)


@pytest.mark.parametrize(
    "dtype, widen, tiles, block, capability",
    [("bf16", False, (16, 64, 128), (128, 128), 90),
     ("fp16", False, (64, 128, 64), (1, 2048), 80),
     ("fp32", True, (16, 16, 16), (48, 32), 90)],
)  # fmt: skip
def test_the_grouped_kernel_compiles_for_cuda_without_a_gpu(dtype, widen, tiles, block,
                                                             capability):  # fmt: skip
    if triton_fp8_gemm.triton is None:
        pytest.skip("triton is not installed")
    kernel = triton_fp8_gemm._fp8_grouped_gemm_kernel
    pointers = dict(x_ptr=dtype, w_ptr="u8", scale_ptr="fp32", ends_ptr="i32", out_ptr=dtype)
    constants = dict(B0=block[0], B1=block[1], BLOCK_M=tiles[0], BLOCK_N=tiles[1],
                     BLOCK_K=tiles[2], BLOCK_E=128, WIDEN=widen)  # fmt: skip
    scalars = {name: "i32" for name in kernel.arg_names[5:11]}
    compile_for_cuda(kernel, pointers, scalars, constants, capability)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", list(CASES) + list(GPU_CASES))
def test_real_kernel_matches_float64(case_id):
    spec = {**CASES, **GPU_CASES}[case_id]
    check_result(run_case(spec, "cuda"), spec)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", list(GROUPED_CASES) + list(GPU_GROUPED_CASES))
def test_real_grouped_kernel_matches_float64(case_id):
    spec = {**GROUPED_CASES, **GPU_GROUPED_CASES}[case_id]
    check_grouped_result(run_grouped_case(spec, "cuda"), spec)
