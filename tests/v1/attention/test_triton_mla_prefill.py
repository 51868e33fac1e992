"""The Triton MLA prefill kernel (``backends/triton_mla_prefill.py``) against attention
written out in float64: chunks of query rows (every head absorbed) over their sequences'
cached latent rows, causal, scores over the whole row, values its first ``value_size``.

Cases: prompts and chunks over a cached prefix in one packed batch (several sequences,
one-row chunks, chunks ending mid-block and on a block's edge), tiny shapes (latent 56 +
rope 8: both padded) and DeepSeek's (512 + 64), 4 to 20 heads (a partial head tile),
block sizes 8/16/32, fp32 / fp16 / bf16 queries, FP8 caches of both kinds. The cache is
NaN wherever no context reaches (the null block 0, unused blocks, the tail of each last
block), so a read past ``seq_len`` shows; ``q``/``out`` have rows before and after the
chunks (decode rows, padding), which must stay untouched. On CPU the kernel runs in
Triton's interpreter in a child process; the same cases and larger ones (V2-Lite's 16
heads over a 4k-token prefix, V3's 128) against the real kernel are marked ``cuda``.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from tests.triton_interpreter import interpreted_cases, print_case_results
from vllm.v1.attention.backends import triton_mla_prefill

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
UNTOUCHED = 7.0  # what ``out`` holds where no chunk writes
LEAD, TRAIL = 2, 3  # rows of q / out before the chunks (decodes) and after (padding)


def mla_prefill_reference(q, cache, table, seqs, cu, scale, value_size, device="cpu",
                          causal=True):  # fmt: skip
    """{i: (q_len, heads, value_size) float64}: sequence i's chunk of ``seqs[i] = (prefix,
    q_len)`` over its cached rows, causal (else every row sees the whole context);
    computed on ``device`` a slab of rows at a time (a 4k-token context's scores in
    float64 are large)."""
    block_size, out = cache.shape[2], {}
    for i, (prefix, q_len) in enumerate(seqs):
        length = prefix + q_len
        pages = table[i, : -(-length // block_size)].long()
        rows = cache[0, pages].flatten(0, 1)[:length, 0].to(device, torch.float64)
        chunk = q[cu[i] : cu[i] + q_len].to(device, torch.float64)  # (q_len, heads, dim)
        parts = []
        for s in range(0, q_len, 256):
            qs = chunk[s : s + 256]
            scores = torch.einsum("qhd,kd->qhk", qs, rows) * scale
            pos = prefix + s + torch.arange(qs.shape[0], device=device)
            sees = torch.arange(length, device=device)[None, :] <= pos[:, None]
            sees |= not causal
            probs = scores.masked_fill(~sees[:, None, :], float("-inf")).softmax(-1)
            parts.append(torch.einsum("qhk,kd->qhd", probs, rows[:, :value_size]).cpu())
        out[i] = torch.cat(parts)
    return out


CASES = {
    "fp32-tiny-bs16": dict(
        heads=4, latent=56, rope=8, block_size=16, seqs=[(0, 37), (45, 20), (100, 1), (16, 16)]
    ),
    "fp32-v2lite-bs16": dict(heads=16, latent=512, rope=64, block_size=16, seqs=[(0, 20), (33, 9)]),
    "bf16-heads20-bs8": dict(
        heads=20, latent=512, rope=64, block_size=8, seqs=[(7, 13), (0, 5)], dtype="bfloat16"
    ),
    "fp16-tiny-bs32": dict(
        heads=4, latent=56, rope=8, block_size=32, seqs=[(70, 40), (0, 1)], dtype="float16"
    ),
    "fp32-kv-fp8e4m3-v2lite": dict(
        heads=16, latent=512, rope=64, block_size=16, seqs=[(40, 12)], kv="float8_e4m3fn"
    ),
    "bf16-kv-fp8e5m2-bs32": dict(
        heads=8,
        latent=56,
        rope=8,
        block_size=32,
        seqs=[(50, 30), (0, 3)],
        dtype="bfloat16",
        kv="float8_e5m2",
    ),  # fmt: skip
}
# The real kernel only (the interpreter would take minutes): V2-Lite's heads over a
# 4k-token prefix (an agent's context, chunked), V3's 128 heads, an FP8 cache.
GPU_CASES = {
    "bf16-v2lite-prefix4k": dict(
        heads=16,
        latent=512,
        rope=64,
        block_size=16,
        seqs=[(4096, 512), (0, 300), (1000, 1)],
        dtype="bfloat16",
    ),  # fmt: skip
    "fp32-v2lite-prefix4k": dict(
        heads=16, latent=512, rope=64, block_size=16, seqs=[(4096, 256), (17, 100)]
    ),
    "bf16-v3-heads128": dict(
        heads=128,
        latent=512,
        rope=64,
        block_size=64,
        seqs=[(2048, 256), (0, 129)],
        dtype="bfloat16",
    ),  # fmt: skip
    "bf16-v2lite-prefix4k-fp8": dict(
        heads=16,
        latent=512,
        rope=64,
        block_size=64,
        seqs=[(4000, 333)],
        dtype="bfloat16",
        kv="float8_e4m3fn",
    ),  # fmt: skip
}


def build_case(spec: dict, device: str, seed: int = 0) -> dict:
    """Scattered blocks, NaN where no context reaches; the chunks' rows packed after LEAD
    rows, ``out`` at UNTOUCHED."""
    block_size, seqs = spec["block_size"], spec["seqs"]
    lens = [p + n for p, n in seqs]
    dim, dtype = spec["latent"] + spec["rope"], getattr(torch, spec.get("dtype", "float32"))
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(needs) + 2  # the null block 0, the contexts', two unused
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    table = torch.zeros(len(lens), max(needs) + 2, dtype=torch.int32)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, (n, need) in enumerate(zip(lens, needs, strict=True)):
        table[i, :need] = torch.tensor([ids.pop() for _ in range(need)], dtype=torch.int32)
        valid[table[i, :need].long()] = True
        valid[table[i, need - 1], (n - 1) % block_size + 1 :] = False
    cache = torch.randn(1, num_blocks, block_size, 1, dim, generator=gen)
    if spec.get("kv"):  # an FP8 cache: magnitudes from 2^-12 (subnormals) to 2^4
        cache *= torch.exp2(torch.randint(-10, 3, cache.shape, generator=gen).float())
    cache[:, ~valid] = float("nan")
    cu = [LEAD]
    for _, n in seqs:
        cu.append(cu[-1] + n)
    rows = cu[-1] + TRAIL
    q = torch.randn(rows, spec["heads"], dim, generator=gen)
    kv_dtype = getattr(torch, spec["kv"]) if spec.get("kv") else dtype
    return dict(
        q=q.to(device, dtype),
        cache=cache.to(device, kv_dtype),
        table=table.to(device),
        lens=torch.tensor(lens, dtype=torch.int32, device=device),
        cu=torch.tensor(cu, dtype=torch.int32, device=device),
        cu_list=cu,
        out=torch.full(
            (rows, spec["heads"], spec["latent"]), UNTOUCHED, dtype=dtype, device=device
        ),  # fmt: skip
        scale=dim**-0.5,
    )


def run_case(spec: dict, device: str, kernel=None) -> dict:
    """The kernel on one case: its worst error against float64 (relative to the chunk's
    largest output where that passes 1: the FP8 cases' values reach 2^4 x the others'),
    whether every chunk output is finite and whether the other rows kept theirs."""
    t = build_case(spec, device)
    kernel = kernel or triton_mla_prefill.mla_prefill_attention
    max_q = max(n for _, n in spec["seqs"])
    out = kernel(t["q"], t["cache"], t["table"], t["lens"], t["cu"], max_q, t["scale"],
                 spec["latent"], out=t["out"])  # fmt: skip
    assert out is t["out"]
    ref = mla_prefill_reference(
        t["q"], t["cache"], t["table"].cpu(), spec["seqs"], t["cu_list"], t["scale"],
        spec["latent"], device=device,
    )  # fmt: skip
    out, cu = out.cpu(), t["cu_list"]
    err = max(
        float((out[cu[i] : cu[i + 1]].double() - r).abs().max() / r.abs().max().clamp(min=1.0))
        for i, r in ref.items()
    )
    others = torch.cat([out[: cu[0]], out[cu[-1] :]])
    return dict(
        max_err=err,
        finite=bool(torch.isfinite(out[cu[0] : cu[-1]]).all()),
        untouched=bool((others == UNTOUCHED).all()),
    )


def check_result(result: dict, spec: dict) -> None:
    assert "error" not in result, result.get("error")
    assert result["finite"], "a NaN slot past seq_len (or the null block) was read"
    assert result["untouched"], "a row outside the chunks was written"
    assert result["max_err"] <= TOLERANCE[spec.get("dtype", "float32")], result


# -- the kernel in Triton's interpreter (CPU, a child process) ---------------------------------
def interpreter_main() -> None:
    """The child: the case ids on stdin, one JSON line of results on stdout."""
    print_case_results(
        type(triton_mla_prefill._mla_prefill_kernel).__name__,
        json.load(sys.stdin),
        lambda case_id: run_case(CASES[case_id], "cpu"),
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreted_cases(__name__, CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_kernel_matches_float64(interpreted, case_id):
    check_result(interpreted[case_id], CASES[case_id])


def test_the_checks_catch_a_wrong_kernel():
    # The reference and the checks on their own, with emulated kernels (no Triton): one
    # whose rows all see the whole chunk (not causal), one that takes the values
    # from the rows' last dims, one that writes every row; each fails them.
    spec = CASES["fp32-tiny-bs16"]

    def emulated(wrong: str):
        def kernel(q, cache, table, lens, cu, max_q, scale, value_size, out):
            if wrong == "last-dims":
                cache, q = cache.flip(-1), q.flip(-1)
            ref = mla_prefill_reference(q, cache, table, spec["seqs"], cu.tolist(), scale,
                                        value_size, causal=wrong != "not-causal")  # fmt: skip
            for i, r in ref.items():
                out[cu[i] : cu[i + 1]] = r.to(out.dtype)
            if wrong == "write-all":
                out[:] = out[cu[0]].clone()
            return out

        return kernel

    check_result(run_case(spec, "cpu", emulated("right")), spec)
    with pytest.raises(AssertionError, match="max_err"):
        check_result(run_case(spec, "cpu", emulated("not-causal")), spec)
    with pytest.raises(AssertionError, match="max_err"):
        check_result(run_case(spec, "cpu", emulated("last-dims")), spec)
    assert not run_case(spec, "cpu", emulated("write-all"))["untouched"]


def test_the_arguments_are_checked():
    q = torch.zeros(5, 4, 64)
    cache = torch.zeros(1, 3, 16, 1, 64)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    check = triton_mla_prefill._check_args
    check(q, cache, table, lens, cu, torch.zeros(5, 4, 56), 56)
    with pytest.raises(ValueError, match="latent cache"):  # K and V halves
        check(q, torch.zeros(2, 3, 16, 1, 64), table, lens, cu, torch.zeros(5, 4, 56), 56)
    with pytest.raises(ValueError, match="out"):
        check(q, cache, table, lens, cu, torch.zeros(5, 4, 64), 56)
    with pytest.raises(ValueError, match="cu_seq_q"):
        check(q, cache, table, lens, cu[:2], torch.zeros(5, 4, 56), 56)


def test_tile_shape_fills_dot_m_with_heads_first():
    assert triton_mla_prefill.BLOCK_M == 32
    assert triton_mla_prefill.tile_shape(16) == (2, 16)  # V2-Lite
    assert triton_mla_prefill.tile_shape(128) == (1, 32)  # V3: 4 programs a query row
    assert triton_mla_prefill.tile_shape(4) == (8, 4)
    assert triton_mla_prefill.tile_shape(20) == (1, 32)
    assert triton_mla_prefill.tile_shape(1) == (16, 2)


def test_the_kernel_is_offered_where_triton_runs(monkeypatch):
    reason = triton_mla_prefill.prefill_unavailable_reason
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if triton_mla_prefill.triton is None:
        assert "not installed" in reason(torch.device("cpu"))
        return
    assert "CUDA, not cpu" in reason(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert reason(torch.device("cpu")) is None


# -- the kernel on a GPU -------------------------------------------------------------------------
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", list(CASES) + list(GPU_CASES))
def test_real_kernel_matches_float64(case_id):
    spec = {**CASES, **GPU_CASES}[case_id]
    check_result(run_case(spec, "cuda"), spec)
