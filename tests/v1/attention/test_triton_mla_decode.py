"""The Triton MLA decode kernel (``backends/triton_mla_decode.py``) against attention written
out in float64: many query heads over one latent row per token, scores over the whole
row (latent + rotated key), values its first ``value_size`` dims.

Cases: tiny shapes (latent 56, rope 8: both padded) and DeepSeek's (512 + 64), 4 to 20
heads (a partial head tile), block sizes 8/16/32, contexts of 1 to 300 tokens, fp32 /
fp16 / bf16 queries, FP8 caches of both kinds, split-K (some splits empty) and a padding
sequence of length 0. The cache is NaN wherever no context reaches (the null block 0 that
pads the tables, unused blocks, the tail of each last block), so a read past ``seq_len``
shows; ``out`` has rows past the sequences, which must stay untouched. On CPU the kernel
runs in Triton's interpreter in a child process (``tests/triton_interpreter.py``); the
same cases and larger ones (V2-Lite's and V3's head counts) against the real kernel are
marked ``cuda``.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from tests.triton_interpreter import interpreted_cases, print_case_results
from vllm.v1.attention.backends import triton_mla_decode

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
UNTOUCHED = 7.0  # what ``out`` holds where no sequence writes
EXTRA_ROWS = 2  # rows of q / out past the sequences


def mla_reference(q, cache, table, lens, scale, value_size) -> dict[int, torch.Tensor]:
    """{i: (heads, value_size) float64}: sequence i's query over its first ``lens[i]``
    latent rows; zeros for a sequence of length 0."""
    block_size = cache.shape[2]
    out = {}
    for i, length in enumerate(lens.tolist()):
        if length == 0:
            out[i] = torch.zeros(q.shape[1], value_size, dtype=torch.float64)
            continue
        pages = table[i, : -(-length // block_size)].long()
        rows = cache[0, pages].flatten(0, 1)[:length, 0].double()  # (length, dim)
        probs = (q[i].double() @ rows.T * scale).softmax(-1)  # (heads, length)
        out[i] = probs @ rows[:, :value_size]
    return out


def _lens(batch: int, block_size: int) -> list[int]:
    return [300, 1, block_size + 1, block_size, 2 * block_size - 1, 129][:batch]


CASES = {
    "fp32-tiny-bs16": dict(heads=4, latent=56, rope=8, block_size=16, lens=_lens(3, 16)),
    "fp32-v2lite-bs16": dict(heads=16, latent=512, rope=64, block_size=16, lens=_lens(4, 16)),
    "fp32-tiny-bs32-split2": dict(
        heads=4, latent=56, rope=8, block_size=32, lens=_lens(6, 32), splits=2
    ),
    "bf16-heads20-bs8-split4": dict(
        heads=20,
        latent=512,
        rope=64,
        block_size=8,
        lens=_lens(3, 8),
        splits=4,
        dtype="bfloat16",
    ),  # fmt: skip
    "fp16-tiny-bs8-split16-padding": dict(
        heads=4, latent=56, rope=8, block_size=8, lens=[0, 300, 5], splits=16, dtype="float16"
    ),
    "fp32-padding-row": dict(heads=4, latent=56, rope=8, block_size=16, lens=[0, 40]),
    "fp32-kv-fp8e4m3-bs16": dict(
        heads=16, latent=512, rope=64, block_size=16, lens=_lens(3, 16), kv="float8_e4m3fn"
    ),
    "bf16-kv-fp8e5m2-bs32-split4": dict(
        heads=8,
        latent=56,
        rope=8,
        block_size=32,
        lens=_lens(5, 32),
        splits=4,
        dtype="bfloat16",
        kv="float8_e5m2",
    ),  # fmt: skip
}
# Larger shapes for the real kernel only (the interpreter would take minutes).
GPU_CASES = {
    "bf16-v2lite-long": dict(
        heads=16, latent=512, rope=64, block_size=16, lens=[2000, 1, 640, 513], dtype="bfloat16"
    ),
    "bf16-v3-heads128-batch32": dict(
        heads=128,
        latent=512,
        rope=64,
        block_size=16,
        lens=list(range(1, 640, 20)),
        dtype="bfloat16",
    ),  # fmt: skip
    "bf16-v2lite-bs64-fp8": dict(
        heads=16,
        latent=512,
        rope=64,
        block_size=64,
        lens=[1500, 3],
        dtype="bfloat16",
        kv="float8_e4m3fn",
    ),  # fmt: skip
}


def build_case(spec: dict, device: str, seed: int = 0) -> dict:
    """Scattered blocks, NaN where no context reaches; ``out`` starts at UNTOUCHED."""
    block_size, lens = spec["block_size"], spec["lens"]
    dim, dtype = spec["latent"] + spec["rope"], getattr(torch, spec.get("dtype", "float32"))
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(needs) + 2  # the null block 0, the contexts', two unused
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    table = torch.zeros(len(lens), max(needs, default=0) + 2, dtype=torch.int32)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, (n, need) in enumerate(zip(lens, needs, strict=True)):
        table[i, :need] = torch.tensor([ids.pop() for _ in range(need)], dtype=torch.int32)
        for p in range(n):
            valid[table[i, p // block_size], p % block_size] = True
    cache = torch.randn(1, num_blocks, block_size, 1, dim, generator=gen)
    if spec.get("kv"):  # an FP8 cache: magnitudes from 2^-12 (subnormals) to 2^4
        cache *= torch.exp2(torch.randint(-10, 3, cache.shape, generator=gen).float())
    cache[:, ~valid] = float("nan")
    rows = len(lens) + EXTRA_ROWS
    q = torch.randn(rows, spec["heads"], dim, generator=gen)
    return dict(
        q=q.to(device, dtype),
        cache=cache.to(device, getattr(torch, spec["kv"]) if spec.get("kv") else dtype),
        table=table.to(device),
        lens=torch.tensor(lens, dtype=torch.int32, device=device),
        out=torch.full(
            (rows, spec["heads"], spec["latent"]), UNTOUCHED, dtype=dtype, device=device
        ),  # fmt: skip
        scale=dim**-0.5,
    )


def run_case(spec: dict, device: str) -> dict:
    """The kernel on one case: its worst error against float64 (relative to the sequence's
    largest output where that passes 1: the FP8 cases' values reach 2^4 x the others'),
    whether every output is finite and whether the rows past the sequences kept theirs."""
    t = build_case(spec, device)
    out = triton_mla_decode.mla_decode_attention(
        t["q"], t["cache"], t["table"], t["lens"], t["scale"], spec["latent"], out=t["out"],
        num_splits=spec.get("splits"),
    )  # fmt: skip
    assert out is t["out"]
    out = out.cpu()
    ref = mla_reference(
        t["q"].cpu(), t["cache"].cpu(), t["table"].cpu(), t["lens"].cpu(), t["scale"],
        spec["latent"],
    )  # fmt: skip
    err = max(
        float((out[i].double() - r).abs().max() / r.abs().max().clamp(min=1.0))
        for i, r in ref.items()
    )
    return dict(
        max_err=err,
        finite=bool(torch.isfinite(out[: len(ref)]).all()),
        untouched=bool((out[len(ref) :] == UNTOUCHED).all()),
    )


def check_result(result: dict, spec: dict) -> None:
    assert "error" not in result, result.get("error")
    assert result["finite"], "a NaN slot past seq_len (or the null block) was read"
    assert result["untouched"], "a row past the sequences was written"
    assert result["max_err"] <= TOLERANCE[spec.get("dtype", "float32")], result


# -- the kernel in Triton's interpreter (CPU, a child process) ---------------------------------
def interpreter_main() -> None:
    """The child: the case ids on stdin, one JSON line of results on stdout."""
    print_case_results(
        type(triton_mla_decode._mla_decode_kernel).__name__,
        json.load(sys.stdin),
        lambda case_id: run_case(CASES[case_id], "cpu"),
    )


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreted_cases(__name__, CASES)


@pytest.mark.parametrize("case_id", list(CASES))
def test_interpreted_kernel_matches_float64(interpreted, case_id):
    check_result(interpreted[case_id], CASES[case_id])


def test_the_checks_catch_a_wrong_kernel(monkeypatch):
    # The reference and the checks on their own, with an emulated kernel (no Triton): one
    # that reads the whole last block, one that takes the values from the rows' last
    # dims, and one that writes every row fail them.
    def emulated(q, cache, table, lens, scale, value_size, out, num_splits=None):
        full = -(-lens // cache.shape[2]) * cache.shape[2] if read_past else lens
        if wrong_values:  # values from the rows' last value_size dims
            cache = cache.flip(-1)
            q = q.flip(-1)
        for i, o in mla_reference(q, cache, table, full, scale, value_size).items():
            out[i] = o.to(out.dtype)
        if write_all:
            out[:] = out[0].clone()
        return out

    monkeypatch.setattr(triton_mla_decode, "mla_decode_attention", emulated)
    spec = CASES["fp32-tiny-bs16"]
    read_past = wrong_values = write_all = False
    check_result(run_case(spec, "cpu"), spec)
    read_past = True
    assert not run_case(spec, "cpu")["finite"]
    read_past, wrong_values = False, True
    with pytest.raises(AssertionError, match="max_err"):
        check_result(run_case(spec, "cpu"), spec)
    wrong_values, write_all = False, True
    assert not run_case(spec, "cpu")["untouched"]


def test_the_arguments_are_checked():
    q = torch.zeros(2, 4, 64)
    cache = torch.zeros(1, 3, 16, 1, 64)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    check = triton_mla_decode._check_args
    check(q, cache, table, lens, torch.zeros(2, 4, 56), 56, 1)
    with pytest.raises(ValueError, match="latent cache"):  # K and V halves
        check(q, torch.zeros(2, 3, 16, 1, 64), table, lens, torch.zeros(2, 4, 56), 56, 1)
    with pytest.raises(ValueError, match="value_size"):
        check(q, cache, table, lens, torch.zeros(2, 4, 64), 64, 1)
    with pytest.raises(ValueError, match="out"):
        check(q, cache, table, lens, torch.zeros(2, 4, 64), 56, 1)
    with pytest.raises(ValueError, match="num_splits"):
        check(q, cache, table, lens, torch.zeros(2, 4, 56), 56, 3)


# -- the kernel on a GPU -------------------------------------------------------------------------
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", list(CASES) + list(GPU_CASES))
def test_real_kernel_matches_float64(case_id):
    spec = {**CASES, **GPU_CASES}[case_id]
    check_result(run_case(spec, "cuda"), spec)
