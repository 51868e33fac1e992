"""The Triton paged prefill kernel (``backends/triton_prefill.py``) against float64.

Cases: whole prompts, chunks over a cached prefix, one-token rows (decodes) in the same
batch, chunks longer than a tile of queries, block sizes 8/16/32, GQA ratios 1/2/4/8, head
sizes 24/64/128, fp32/fp16/bf16; sliding windows (inside a tile, wider than a chunk, of one
position), soft caps (Gemma 2's 50, and 2) and sinks, alone and together. The cache is NaN
wherever no query may read (the null block 0 that pads the tables, unused blocks, each
context's tail past its length, positions before the first query's window), so a read
there shows; ``out``'s rows are all owned. On CPU the kernel runs in Triton's interpreter
(a child process, as in test_triton_decode.py); the same cases and larger shapes against
the real kernel are marked ``cuda``.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch

from tests.triton_interpreter import interpreted_cases, print_case_results
from vllm.v1.attention.backends import triton_prefill

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}


def prefill_reference(q, kv_cache, block_table, seq_lens, cu_seq_q, scale, window=0,
                      soft_cap=0.0, sinks=None, causal=True):  # fmt: skip
    """(num_tokens, heads, dim) float64: each sequence's chunk (its last q_len positions)
    over its keys, causal, the last ``window`` positions of each query when > 0."""
    heads, kv_heads, block_size = q.shape[1], kv_cache.shape[3], kv_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, length in enumerate(seq_lens.tolist()):
        qs, qe = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        pages = block_table[i, : -(-length // block_size)].long()
        keys, values = (
            half[pages].flatten(0, 1)[:length].double().repeat_interleave(heads // kv_heads, 1)
            for half in kv_cache.unbind(0)
        )
        q_pos = torch.arange(length - (qe - qs), length)[:, None]
        k_pos = torch.arange(length)[None, :]
        sees = (k_pos <= q_pos) if causal else (k_pos < length)
        if window:
            sees &= k_pos > q_pos - window
        # Unreadable slots are NaN: give the masked-out keys zeros before the products.
        keys = torch.where(sees.any(0)[:, None, None], keys, 0.0)
        values = torch.where(sees.any(0)[:, None, None], values, 0.0)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe].double(), keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(~sees, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(-1, 1, 1).expand(heads, qe - qs, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


# (prefix, chunk) per sequence.
MIXED = [(0, 37), (20, 1), (100, 70), (5, 9), (0, 1), (64, 16)]


def _cases() -> dict[str, dict]:
    cases = {}
    for block_size, ratio, dtype in [(8, 1, "float32"), (16, 4, "float32"), (32, 8, "float32"),
                                     (16, 2, "float16"), (8, 4, "bfloat16")]:  # fmt: skip
        cases[f"{dtype}-bs{block_size}-gqa{ratio}"] = dict(
            block_size=block_size, ratio=ratio, seqs=MIXED, dtype=dtype
        )
    cases["fp32-bs16-gqa4-long-chunk"] = dict(block_size=16, ratio=4, seqs=[(30, 150), (0, 140)])
    cases["fp32-bs16-gqa3-dim24"] = dict(block_size=16, ratio=3, seqs=MIXED[:3], dim=24)
    cases["fp16-bs16-gqa4-dim128"] = dict(block_size=16, ratio=4, seqs=MIXED[:4], dim=128,
                                          dtype="float16")  # fmt: skip
    cases["fp32-bs8-gqa4-window40"] = dict(block_size=8, ratio=4, seqs=MIXED, window=40)
    cases["fp32-bs16-gqa1-window1"] = dict(block_size=16, ratio=1, seqs=MIXED[:3], window=1)
    cases["bf16-bs16-gqa2-window100"] = dict(block_size=16, ratio=2, seqs=MIXED, window=100,
                                             dtype="bfloat16")  # fmt: skip
    cases["fp32-bs16-gqa4-softcap50"] = dict(block_size=16, ratio=4, seqs=MIXED, soft_cap=50.0,
                                             qscale=8.0)  # fmt: skip
    cases["bf16-bs8-gqa2-softcap2-window30"] = dict(
        block_size=8, ratio=2, seqs=MIXED, soft_cap=2.0, window=30, dtype="bfloat16", qscale=8.0
    )
    cases["fp32-bs16-gqa8-sinks"] = dict(block_size=16, ratio=8, seqs=MIXED, sinks=True)
    cases["fp16-bs8-gqa4-sinks-window20"] = dict(block_size=8, ratio=4, seqs=MIXED, window=20,
                                                 sinks=True, dtype="float16")  # fmt: skip
    cases["fp32-bs32-gqa1-sinks-softcap5"] = dict(block_size=32, ratio=1, seqs=MIXED,
                                                  sinks=True, soft_cap=5.0)  # fmt: skip
    # FP8 caches: their bytes decoded in the kernel.
    cases["fp32-kv-fp8e4m3-bs16-gqa4"] = dict(block_size=16, ratio=4, seqs=MIXED,
                                              kv="float8_e4m3fn")  # fmt: skip
    cases["bf16-kv-fp8e5m2-bs8-gqa2-softcap5-sinks-window30"] = dict(
        block_size=8, ratio=2, seqs=MIXED, soft_cap=5.0, sinks=True, window=30,
        dtype="bfloat16", kv="float8_e5m2",
    )  # fmt: skip
    return cases


CASES = _cases()
GPU_CASES = {
    "bf16-llama8b-bs16": dict(
        block_size=16,
        ratio=4,
        kv_heads=8,
        dim=128,
        dtype="bfloat16",
        seqs=[(0, 2048), (1500, 512), (3000, 1)],
    ),  # fmt: skip
    "bf16-gptoss-bs16-sinks-window128": dict(
        block_size=16,
        ratio=8,
        kv_heads=8,
        dim=64,
        dtype="bfloat16",
        window=128,
        sinks=True,
        seqs=[(0, 1000), (700, 300), (50, 1)],
    ),  # fmt: skip
    "bf16-gemma2-bs16-softcap50-window4096": dict(
        block_size=16,
        ratio=2,
        kv_heads=8,
        dim=256,
        dtype="bfloat16",
        window=4096,
        soft_cap=50.0,
        seqs=[(4000, 600), (0, 900)],
    ),  # fmt: skip
}


def build_case(spec: dict, device: str, seed: int = 0) -> dict:
    block_size, seqs = spec["block_size"], spec["seqs"]
    kv_heads, dim = spec.get("kv_heads", 2), spec.get("dim", 64)
    heads, dtype = kv_heads * spec["ratio"], getattr(torch, spec.get("dtype", "float32"))
    window = spec.get("window", 0)
    gen = torch.Generator().manual_seed(seed)
    lens = [p + n for p, n in seqs]
    needs = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(needs) + 2
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    table = torch.zeros(len(seqs), max(needs) + 2, dtype=torch.int32)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, ((prefix, _), n, need) in enumerate(zip(seqs, lens, needs, strict=True)):
        table[i, :need] = torch.tensor([ids.pop() for _ in range(need)], dtype=torch.int32)
        for p in range(max(0, prefix - window + 1) if window else 0, n):
            valid[table[i, p // block_size], p % block_size] = True
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    if spec.get("kv"):  # an FP8 cache: magnitudes from 2^-12 (subnormals) to 2^4
        cache *= torch.exp2(torch.randint(-10, 3, cache.shape, generator=gen).float())
    cache[:, ~valid] = float("nan")
    tokens = sum(n for _, n in seqs)
    q = torch.randn(tokens, heads, dim, generator=gen) * spec.get("qscale", 1.0)
    sinks = torch.randn(heads, generator=gen) * 3 if spec.get("sinks") else None
    cu = torch.tensor([0] + [n for _, n in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return dict(
        q=q.to(device, dtype),
        cache=cache.to(device, getattr(torch, spec["kv"]) if spec.get("kv") else dtype),
        table=table.to(device),
        lens=torch.tensor(lens, dtype=torch.int32, device=device),
        cu=cu.to(device),
        max_q=max(n for _, n in seqs),
        scale=dim**-0.5,
        sinks=None if sinks is None else sinks.to(device, dtype),
    )


def run_case(spec: dict, device: str, kernel=None) -> dict:
    t = build_case(spec, device)
    window, soft_cap = spec.get("window", 0), spec.get("soft_cap", 0.0)
    kernel = kernel or triton_prefill.paged_prefill_attention
    out = kernel(
        t["q"], t["cache"], t["table"], t["lens"], t["cu"], t["max_q"], t["scale"],
        window=window, soft_cap=soft_cap, sinks=t["sinks"],
    )  # fmt: skip
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    ref = prefill_reference(
        cpu["q"], cpu["cache"], cpu["table"], cpu["lens"], cpu["cu"], t["scale"], window,
        soft_cap, cpu["sinks"],
    )  # fmt: skip
    out = out.cpu()
    return dict(
        max_err=float((out.double() - ref).abs().max()),
        finite=bool(torch.isfinite(out).all()),
        ref_max=float(ref.abs().max()),
    )


def check_result(result: dict, spec: dict) -> None:
    assert "error" not in result, result.get("error")
    assert result["finite"], "a NaN slot (past a context, or before a window) was read"
    # The dtype's rounding, relative to the outputs' size (FP8 cases reach 2^4 x randn).
    scale = max(1.0, result.get("ref_max", 1.0) / 4)
    assert result["max_err"] <= TOLERANCE[spec.get("dtype", "float32")] * scale, result


def interpreter_main() -> None:
    print_case_results(
        type(triton_prefill._prefill_kernel).__name__,
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
    # The reference and the checks with emulated kernels (no Triton): a right one passes;
    # one that is not causal, one that ignores the window, the soft cap or the sinks, and
    # one that reads a NaN slot fail.
    def emulated(mistake):
        def kernel(q, cache, table, lens, cu, max_q, scale, window=0, soft_cap=0.0, sinks=None):
            if mistake == "window":
                window = 0
            soft_cap = 0.0 if mistake == "soft_cap" else soft_cap
            sinks = None if mistake == "sinks" else sinks
            out = prefill_reference(
                q, cache, table, lens, cu, scale, window, soft_cap, sinks, mistake != "acausal"
            )
            if mistake == "nan":
                out[0, 0, 0] = float("nan")
            return out.to(q.dtype)

        return kernel

    plain, windowed = CASES["float32-bs16-gqa4"], CASES["fp32-bs8-gqa4-window40"]
    check_result(run_case(plain, "cpu", emulated(None)), plain)
    check_result(run_case(windowed, "cpu", emulated(None)), windowed)
    for mistake, spec in [("acausal", plain), ("window", windowed), ("nan", plain),
                          ("soft_cap", CASES["fp32-bs16-gqa4-softcap50"]),
                          ("sinks", CASES["fp32-bs16-gqa8-sinks"])]:  # fmt: skip
        with pytest.raises(AssertionError):
            check_result(run_case(spec, "cpu", emulated(mistake)), spec)


def test_arguments_are_checked_before_any_launch():
    t = build_case(CASES["float32-bs8-gqa1"], "cpu")
    args = (t["q"], t["cache"], t["table"], t["lens"], t["cu"], t["max_q"], t["scale"])
    if triton_prefill.triton is None:
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match="window"):
        triton_prefill.paged_prefill_attention(*args, window=-1)
    with pytest.raises(ValueError, match="soft_cap"):
        triton_prefill.paged_prefill_attention(*args, soft_cap=float("inf"))
    with pytest.raises(ValueError, match="sinks"):
        triton_prefill.paged_prefill_attention(*args, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="cu_seq_q"):
        triton_prefill.paged_prefill_attention(*args[:4], t["cu"][:-1], *args[5:])


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", list(CASES) + list(GPU_CASES))
def test_real_kernel_matches_float64(case_id):
    spec = {**CASES, **GPU_CASES}[case_id]
    check_result(run_case(spec, "cuda"), spec)
