"""The grouped Triton W4A16 GEMM (``triton_w4a16.w4a16_grouped_linear``): 4-bit MoE experts
over expert-sorted rows, in Triton's interpreter on CPU against float64 (uneven and empty
expert groups, shapes not multiples of the tiles, several group sizes, fp32 / bf16 /
fp16), compiled to sm80/sm90 cubins without a GPU, and on CUDA (skipped here) the real
kernel, in a CUDA graph too."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.triton_interpreter import interpreted_cases, print_case_results
from vllm.model_executor.layers import triton_w4a16
from vllm.model_executor.layers.quantization import int4

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# counts: rows per expert (zeros: experts no row chose); rows past the last end get zeros
CASES = {
    "fp32-g32-uneven": dict(counts=[3, 0, 17, 1], k=96, n=70, group=32),
    "fp32-g128-partial-group-empty-ends": dict(counts=[0, 5, 0], k=200, n=33, group=128),
    "bf16-g16-tiles-16": dict(counts=[9, 2, 0, 14, 1], k=64, n=40, group=16, dtype="bfloat16",
                              block_m=16, block_n=16, block_k=16),
    "fp16-one-group-tail": dict(counts=[4, 4], k=136, n=24, group=136, dtype="float16",
                                tail=3),
}  # fmt: skip
GPU_CASES = {  # Qwen3-30B-A3B's down projections at decode and a prefill, groups of 128
    "bf16-30b-down-decode": dict(counts=[1] * 8 + [0] * 120, k=768, n=2048, group=128,
                                 dtype="bfloat16"),
    "bf16-prefill": dict(counts=[37, 0, 300, 5] * 4, k=2048, n=1536, group=128,
                         dtype="bfloat16"),
}  # fmt: skip


def build_case(spec: dict, device: str) -> dict:
    g = torch.Generator().manual_seed(spec["k"] * 7 + spec["n"])
    e, k, n, group = len(spec["counts"]), spec["k"], spec["n"], spec["group"]
    groups = -(-k // group)
    q = torch.randint(0, 16, (e, k, n), generator=g)
    zeros = torch.randint(0, 17, (e, groups, n), generator=g)  # 16: GPTQ v1's unwrapped zero
    scales = (torch.rand(e, groups, n, generator=g) * 0.02 + 0.001).half().float()
    rows = sum(spec["counts"]) + spec.get("tail", 0)
    x = torch.randn(rows, k, generator=g).to(DTYPES[spec.get("dtype", "float32")])
    ends = torch.tensor(spec["counts"]).cumsum(0).to(torch.int32)
    qweight = torch.stack([int4.pack_rows(qe) for qe in q])
    return dict(q=q, zeros=zeros, scales=scales, x=x, ends=ends,
                args=[t.to(device) for t in (x, qweight, scales, zeros.to(torch.uint8))],
                ends_d=ends.to(device))  # fmt: skip


def reference(t: dict, spec: dict) -> torch.Tensor:
    """float64 per expert, each weight rounded once to x's dtype as the kernel does; rows
    past the last end are zeros."""
    g = torch.arange(spec["k"]) // spec["group"]
    x = t["x"]
    out = torch.zeros(x.shape[0], spec["n"], dtype=torch.float64)
    start = 0
    for e, end in enumerate(t["ends"].tolist()):
        w = (t["q"][e] - t["zeros"][e][g]).double() * t["scales"][e][g].double()
        out[start:end] = x[start:end].double() @ w.to(x.dtype).double()
        start = end
    return out


def run_case(spec: dict, device: str) -> dict:
    t = build_case(spec, device)
    tiles = {k: spec[k] for k in ("block_m", "block_n", "block_k") if k in spec}
    y = triton_w4a16.w4a16_grouped_linear(*t["args"], spec["group"], t["ends_d"], **tiles)
    ref = reference(t, spec)
    err = (y.cpu().double() - ref).abs().max().item()
    return {"err": err, "scale": ref.abs().max().item(), "dtype": str(y.dtype)}


def check_result(result: dict, spec: dict, interpreted: bool = False) -> None:
    assert "error" not in result, result["error"]
    dtype = spec.get("dtype", "float32")
    assert result["dtype"] == f"torch.{dtype}"
    # fp32: summation order only; 16-bit: the output's own rounding (8 / 11 mantissa bits).
    # Triton's interpreter casts fp32 to bf16 by truncation (1.00488 -> 1.0, not 1.0078),
    # so its bf16 weights may be one unit in the last place off the reference's.
    rel = {"float32": 1e-5, "bfloat16": 1.6e-2 if interpreted else 8e-3, "float16": 1e-3}[dtype]
    assert result["err"] <= rel * result["scale"], result


def interpreter_main() -> None:
    kernel = type(triton_w4a16._w4a16_grouped_kernel).__name__
    print_case_results(kernel, json.load(sys.stdin), lambda c: run_case(CASES[c], "cpu"))


@pytest.fixture(scope="module")
def interpreted():
    return interpreted_cases(__name__, list(CASES))


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_grouped_kernel_matches_float64(interpreted, case_id):
    check_result(interpreted[case_id], CASES[case_id], interpreted=True)


def test_bad_arguments_are_refused():
    t = build_case(CASES["fp32-g32-uneven"], "cpu")
    x, qw, s, z = t["args"]
    f = triton_w4a16.w4a16_grouped_linear
    with pytest.raises(ValueError, match="expert_ends"):
        f(x, qw, s, z, 32, t["ends_d"].long())
    with pytest.raises(ValueError, match="expert_ends"):
        f(x, qw, s, z, 32, t["ends_d"][:2])
    with pytest.raises(ValueError, match="hold 4 experts"):
        f(x, qw, s[:2], z, 32, t["ends_d"])
    with pytest.raises(ValueError, match="3-d"):
        f(x, qw[0], s, z, 32, t["ends_d"])
    with pytest.raises(ValueError, match="columns"):
        f(x[:, :64], qw, s, z, 32, t["ends_d"])
    with pytest.raises(ValueError, match="tiles"):
        f(x, qw, s, z, 32, t["ends_d"], block_n=48)


def _compile(dtype: str, capability: int) -> None:
    kernel = triton_w4a16._w4a16_grouped_kernel if triton_w4a16.triton is not None else None
    if kernel is None:
        pytest.skip("triton is not installed")
    if not hasattr(kernel, "arg_names"):
        pytest.skip("TRITON_INTERPRET is set in this process")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(x_ptr="*" + dtype, qw_ptr="*i32", scales_ptr="*fp32", zeros_ptr="*u8",
                     ends_ptr="*i32", out_ptr="*" + dtype, num_rows="i32", N="i32", K="i32",
                     num_groups="i32", group_size="i32", num_experts="i32", stride_xm="i32",
                     stride_om="i32")  # fmt: skip
    constants = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, BLOCK_E=128, WIDEN=dtype == "fp32")
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
def test_grouped_kernel_compiles_to_cubins(dtype, capability):
    _compile(dtype, capability)


@pytest.mark.cuda
@pytest.mark.parametrize("case_id", list(CASES) + list(GPU_CASES))
def test_real_grouped_kernel_matches_float64(case_id):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = {**CASES, **GPU_CASES}[case_id]
    check_result(run_case(spec, "cuda"), spec)


@pytest.mark.cuda
def test_real_grouped_kernel_replays_in_a_cuda_graph_with_new_expert_ends():
    """Captured once, replayed after the expert ends change on the device: the launch
    read nothing on the host."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    spec = dict(CASES["bf16-g16-tiles-16"])
    t = build_case(spec, "cuda")
    ends = t["ends_d"].clone()
    f = triton_w4a16.w4a16_grouped_linear
    f(*t["args"], spec["group"], ends)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = f(*t["args"], spec["group"], ends)
    spec["counts"] = [0, 14, 9, 2, 1]
    t2 = build_case(spec, "cpu")
    ends.copy_(t2["ends"])
    graph.replay()
    ref = reference({**t2, "x": t["x"], "q": t["q"], "zeros": t["zeros"],
                     "scales": t["scales"]}, spec)  # fmt: skip
    err = (y.cpu().double() - ref).abs().max().item()
    assert err <= 8e-3 * ref.abs().max().item()
