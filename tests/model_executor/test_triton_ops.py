"""The fused Triton layer ops (``vllm/model_executor/layers/triton_ops.py``) against float64
references and ``_custom_ops``' dispatch to them.

Cases: RMSNorm with and without the residual add (hidden sizes a power of two and not,
fp32 and bf16), the rotary embedding of q and k as strided views of a fused qkv output
(head sizes 8 and 16, GQA, positions out of order), SiLU-and-mul over several column
blocks. On CPU the kernels run in Triton's interpreter, in a child process started with
``TRITON_INTERPRET=1`` (as tests/v1/attention/test_triton_decode.py does); skipped where
triton is not installed. The same cases run on a GPU under the ``cuda`` marker.
"""

from __future__ import annotations

import importlib.util
import json
import zlib
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import print_case_results, run_interpreted
from vllm import _custom_ops as ops

REPO = Path(__file__).resolve().parents[2]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The kernels round once from fp32; bf16 keeps 8 bits of mantissa.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}

CASES = {
    f"{op}-{dtype}-{size}": dict(op=op, dtype=dtype, size=size)
    for op, sizes in (
        ("rms_norm", (64, 100)),
        ("fused_add_rms_norm", (64, 100)),
        ("rotary", (8, 16)),
        ("rotary_cache", (8, 16)),
        ("silu_and_mul", (40, 1500)),
    )
    for size in sizes
    for dtype in DTYPES
}


def _max_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    return float(((got - ref).abs() / (ref.abs() + 1.0)).max())


def run_case(spec: dict, device: str) -> dict:
    """One op on one case: its worst error (relative to |ref| + 1) against float64, and
    that nothing outside its outputs was written."""
    from vllm.model_executor.layers import triton_ops

    gen = torch.Generator().manual_seed(zlib.crc32(json.dumps(spec, sort_keys=True).encode()))
    dtype, size, op = DTYPES[spec["dtype"]], spec["size"], spec["op"]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    errs = {}
    if op in ("rms_norm", "fused_add_rms_norm"):
        x, residual, weight, eps = rand(5, size), rand(5, size), rand(size), 1e-6
        x64, r64, w64 = x.double(), residual.double(), weight.double()
        if op == "rms_norm":
            out = triton_ops.rms_norm(x, weight, eps)
            h = x64
        else:
            out = x
            triton_ops.fused_add_rms_norm(x, residual, weight, eps)
            h = (x64 + r64).to(dtype).double()  # the residual is stored rounded
            errs["residual"] = _max_rel_err(residual, h)
        ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w64
        errs["out"] = _max_rel_err(out, ref)
    elif op == "rotary":
        head, q_heads, k_heads, tokens = size, 4, 2, 6
        qkv = rand(tokens, (q_heads + 2 * k_heads) * head)
        before = qkv.clone()
        q = qkv[:, : q_heads * head]
        k = qkv[:, q_heads * head : (q_heads + k_heads) * head]
        positions = torch.tensor([7, 0, 3, 30, 2, 19], device=device)
        inv = 1.0 / 10000 ** (torch.arange(0, head, 2, dtype=torch.float64) / head)
        freqs = torch.outer(torch.arange(32, dtype=torch.float64), inv)
        cache = torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype).to(device)
        triton_ops.rotary_embedding(positions, q, k, head, cache)
        cos, sin = cache.double().cpu()[positions.cpu()].unsqueeze(1).chunk(2, -1)
        for name, x0, heads in (("q", before[:, : q_heads * head], q_heads),
                                ("k", before[:, q_heads * head : (q_heads + k_heads) * head],
                                 k_heads)):  # fmt: skip
            x1, x2 = x0.double().cpu().view(tokens, heads, head).chunk(2, -1)
            ref = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).view(tokens, -1)
            errs[name] = _max_rel_err(q if name == "q" else k, ref)
        v_cols = slice((q_heads + k_heads) * head, None)
        errs["v untouched"] = float(not torch.equal(qkv[:, v_cols], before[:, v_cols]))
    elif op == "rotary_cache":
        # rotary_embedding_and_cache: the same rotation as rotary_embedding (one kernel
        # serves both; the case above holds it to float64), and the rotated k and v in
        # their slots of a paged cache, bit for bit; every other slot untouched.
        head, q_heads, k_heads, tokens, blocks, block = size, 4, 2, 6, 5, 4
        qkv = rand(tokens, (q_heads + 2 * k_heads) * head)
        ref = qkv.clone()
        split = [q_heads * head, k_heads * head, k_heads * head]
        q, k, v = qkv.split(split, dim=-1)
        rq, rk, rv = ref.split(split, dim=-1)
        positions = torch.tensor([7, 0, 3, 30, 2, 19], device=device)
        slots = torch.tensor([9, 2, 17, 3, 10, 0], device=device)  # out of order, gaps
        inv = 1.0 / 10000 ** (torch.arange(0, head, 2, dtype=torch.float64) / head)
        freqs = torch.outer(torch.arange(32, dtype=torch.float64), inv)
        cache = torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype).to(device)
        kv_cache = rand(2, blocks, block, k_heads, head)
        expected = kv_cache.clone()
        triton_ops.rotary_embedding_and_cache(positions, q, k, v, head, cache, kv_cache, slots)
        triton_ops.rotary_embedding(positions, rq, rk, head, cache)
        ops.reshape_and_cache_torch(
            rk.reshape(tokens, k_heads, head), rv.reshape(tokens, k_heads, head), expected,
            slots, padded=False,
        )  # fmt: skip
        errs["q and k as rotary_embedding"] = float(not torch.equal(qkv, ref))
        errs["cache as rotary then reshape_and_cache"] = float(not torch.equal(kv_cache, expected))
    else:
        x = rand(3, 2 * size)
        out = triton_ops.silu_and_mul(x)
        g, u = x.double().chunk(2, -1)
        errs["out"] = _max_rel_err(out, torch.nn.functional.silu(g) * u)
        assert out.shape == (3, size) and out.dtype == dtype
    return errs


def check(errs: dict, spec: dict) -> None:
    assert "error" not in errs, errs.get("error")
    assert errs.pop("v untouched", 0.0) == 0.0, "the rotary kernel wrote v"
    worst = max(errs.values())
    assert worst <= TOLERANCE[spec["dtype"]], errs


def interpreter_main() -> None:
    """The child: every case's errors as one JSON line (TRITON_INTERPRET=1 set)."""
    from vllm.model_executor.layers import triton_ops

    print_case_results(
        triton_ops._interpreted(), CASES, lambda case_id: run_case(CASES[case_id], "cpu")
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    results = run_interpreted(__name__, timeout=300)
    assert results.pop("interpreted"), "the kernels were not interpreted"
    return results


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_kernels_match_float64(interpreted, case_id):
    check(interpreted[case_id], CASES[case_id])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("case_id", list(CASES))
def test_kernels_match_float64_on_cuda(case_id):
    check(run_case(CASES[case_id], "cuda"), CASES[case_id])


# -- _custom_ops' dispatch ------------------------------------------------------------------
class Recorder:
    """Stands in for ``triton_ops``: records which op ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name):
        def op(*args, **kwargs):
            self.calls.append(name)
            return args[0]

        return op


def test_cuda_tensors_go_to_the_fused_ops(monkeypatch):
    # ``_fused`` answers for "CUDA" tensors; bf16 keeps the CPU's native kernels out of it.
    fused = Recorder()
    monkeypatch.setattr(ops, "_fused", lambda t: fused)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    w = torch.ones(32, dtype=torch.bfloat16)
    ops.rms_norm(x, w, 1e-6)
    ops.fused_add_rms_norm(x, x.clone(), w, 1e-6)
    qkv = torch.randn(4, 64, dtype=torch.bfloat16)
    ops.rotary_embedding(torch.arange(4), qkv[:, :32], qkv[:, 32:48], 16, torch.ones(8, 16))
    ops.silu_and_mul(x)
    ops.rotary_embedding_and_cache(torch.arange(4), qkv[:, :32], qkv[:, 32:48], qkv[:, 48:],
                                   16, torch.ones(8, 16), torch.zeros(2, 2, 4, 1, 16),
                                   torch.arange(4))  # fmt: skip
    assert fused.calls == ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                           "rotary_embedding_and_cache"]  # fmt: skip
    # A 3-d input (qwen3's per-head q/k norm) or a strided one stays on pure torch.
    fused.calls.clear()
    ops.rms_norm(x.view(4, 2, 16), w[:16], 1e-6)
    ops.fused_add_rms_norm(x[:, ::2], x[:, ::2].clone(), w[:16], 1e-6)
    assert fused.calls == []


def test_fused_ops_are_for_cuda_and_can_be_turned_off(monkeypatch):
    assert ops._fused(torch.zeros(2)) is None  # a CPU tensor
    ops._fused_module.cache_clear()
    monkeypatch.setenv("VLLM_CUDA_FUSED_OPS", "0")
    try:
        assert ops._fused_module() is None
    finally:
        ops._fused_module.cache_clear()
