"""The Triton paged decode kernel (``backends/triton_decode.py``) and TORCH_FLASH_ATTN's
dispatch of decode rows to it.

The kernel against a float64 reference: block sizes 8/16/32 (and 256 on a GPU), GQA ratios
1/3/4/8, contexts of 1 to 300 tokens (partial last blocks, tiles spanning blocks), batches
of 1 to 8, fp32/fp16/bf16, split-K, query rows given through ``rows``, a zero-length
(padding) sequence, and a cache whose every slot outside the contexts (the null block 0
that pads the block tables, unused blocks, the tail of each last block) is NaN, so a read
past ``seq_len`` shows. On CPU the kernel runs in Triton's interpreter, in a child process
started with ``TRITON_INTERPRET=1`` (triton reads it when a kernel is decorated, i.e. when
``triton_decode`` is imported, so this process's compiled kernels are left alone); skipped
where triton is not installed. The same cases against the real kernel, and a decode step
of the backend captured in a CUDA graph and replayed with new lengths and block tables,
are marked ``cuda``.

The dispatch needs no Triton: with the kernel replaced by a float64 emulation checking its
contract, the backend's output on prefill, decode, chunked and mixed batches equals float64
SDPA, the metadata's layout is checked, and the whole forward runs on FakeTensorMode's
CUDA tensors (device placement, no host read).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.triton_interpreter import interpreted_cases, print_case_results
from tests.v1.attention.test_torch_flash import (
    BATCHES,
    check_against_float64,
    install,
    make_batch,
    ref_varlen_attn,
    sdpa_reference,
)
from vllm import _custom_ops as ops
from vllm.v1.attention.backends import torch_flash, triton_decode, triton_prefill
from vllm.v1.attention.backends.torch_flash import (
    TorchFlashAttentionBackend,
    TritonDecodeMetadata,
    build_triton_decode_metadata,
)
from vllm.v1.attention.backends.varlen_metadata import VarlenMetadata, build_varlen_metadata

REPO = Path(__file__).resolve().parents[3]
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
UNTOUCHED = 7.0  # what ``out`` holds where no sequence writes


# -- the float64 reference and the cases ------------------------------------------------------
def decode_reference(
    q, kv_cache, block_table, seq_lens, scale, rows=None, window=0, soft_cap=0.0, sinks=None
):
    """{row: (heads, head_dim) float64}: sequence i's query ``q[rows[i]]`` over the first
    ``seq_lens[i]`` slots of its blocks (the last ``window`` of them when ``window`` > 0),
    scores soft-capped at ``soft_cap`` (> 0) and each head's ``sinks`` logit in its softmax;
    zeros for a sequence of length 0."""
    heads, kv_heads, block_size = q.shape[1], kv_cache.shape[3], kv_cache.shape[2]
    out = {}
    for i, length in enumerate(seq_lens.tolist()):
        row = i if rows is None else int(rows[i])
        if length == 0:
            out[row] = torch.zeros(q.shape[1:], dtype=torch.float64)
            continue
        pages = block_table[i, : -(-length // block_size)].long()
        # (length, heads, dim) each: query head h reads KV head h // group.
        keys, values = (
            half[pages].flatten(0, 1)[:length].double().repeat_interleave(heads // kv_heads, 1)
            for half in kv_cache.unbind(0)
        )
        first = max(0, length - window) if window else 0
        keys, values = keys[first:], values[first:]
        scores = torch.einsum("hd,khd->hk", q[row].double(), keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if sinks is not None:  # a column of the sink logit, dropped after the softmax
            sunk = torch.cat([scores, sinks.double().view(-1, 1)], dim=1).softmax(-1)
            probs = sunk[:, :-1]
        else:
            probs = scores.softmax(-1)
        out[row] = torch.einsum("hk,khd->hd", probs, values)
    return out


def lens_for(batch: int, block_size: int) -> list[int]:
    """Context lengths with partial and exactly full last blocks, 1 and 300 among them."""
    return [300, 1, block_size + 1, block_size, 2 * block_size - 1, 257, 3 * block_size, 129][
        :batch
    ]


def _cases() -> dict[str, dict]:
    cases = {}
    batches = iter([1, 3, 8, 2, 5, 8, 4, 7, 6])
    for block_size in (8, 16, 32):
        for ratio in (1, 4, 8):
            batch = next(batches)
            cases[f"fp32-bs{block_size}-gqa{ratio}-batch{batch}"] = dict(
                block_size=block_size, ratio=ratio, lens=lens_for(batch, block_size)
            )
    for dtype, block_size, ratio, batch in [
        ("float16", 16, 4, 8),
        ("float16", 8, 8, 5),
        ("float16", 32, 1, 3),
        ("bfloat16", 16, 4, 8),
        ("bfloat16", 8, 1, 2),
    ]:
        name = f"{dtype}-bs{block_size}-gqa{ratio}-batch{batch}"
        cases[name] = dict(
            block_size=block_size, ratio=ratio, lens=lens_for(batch, block_size), dtype=dtype
        )
    cases["fp32-bs16-gqa4-split4"] = dict(block_size=16, ratio=4, lens=lens_for(3, 16), splits=4)
    # 16 splits of at most 5 tiles: most splits are empty.
    cases["fp16-bs8-gqa8-split16"] = dict(
        block_size=8, ratio=8, lens=lens_for(2, 8), splits=16, dtype="float16"
    )
    cases["fp32-bs32-gqa1-split2-rows"] = dict(
        block_size=32, ratio=1, lens=lens_for(8, 32), splits=2, rows=True
    )
    cases["fp16-bs16-gqa4-rows"] = dict(
        block_size=16, ratio=4, lens=lens_for(6, 16), rows=True, dtype="float16"
    )
    for splits in (1, 4):  # a padding row (length 0) gets zeros, with or without splits
        cases[f"fp32-bs8-gqa4-padding-row-split{splits}"] = dict(
            block_size=8, ratio=4, lens=[0, 300, 5], splits=splits, rows=True
        )
    cases["fp32-bs16-gqa3-dim24"] = dict(block_size=16, ratio=3, lens=lens_for(4, 16), dim=24)
    cases["fp16-bs16-gqa4-dim128"] = dict(
        block_size=16, ratio=4, lens=lens_for(4, 16), dim=128, dtype="float16"
    )
    # Sliding windows: inside a tile, across tiles and blocks, wider than some contexts,
    # of one position; with splits (some empty) and query rows.
    cases["fp32-bs8-gqa4-window40"] = dict(block_size=8, ratio=4, lens=lens_for(8, 8), window=40)
    cases["fp32-bs16-gqa1-window1"] = dict(block_size=16, ratio=1, lens=lens_for(3, 16), window=1)
    cases["fp16-bs16-gqa4-window100-split4-rows"] = dict(
        block_size=16, ratio=4, lens=[0, 300, 5, 129], window=100, splits=4, rows=True,
        dtype="float16",
    )  # fmt: skip
    cases["fp32-bs32-gqa8-window17-split16"] = dict(
        block_size=32, ratio=8, lens=lens_for(2, 32), window=17, splits=16
    )
    # Soft caps (Gemma 2's 50, and one of 2 that flattens the scores) and sinks (gpt-oss),
    # alone and together, with windows, splits (some empty), rows and a padding row.
    cases["fp32-bs16-gqa4-softcap50"] = dict(
        block_size=16, ratio=4, lens=lens_for(5, 16), soft_cap=50.0, qscale=8.0
    )
    cases["bf16-bs8-gqa2-softcap2-window40-split4"] = dict(
        block_size=8, ratio=2, lens=lens_for(4, 8), soft_cap=2.0, window=40, splits=4,
        dtype="bfloat16", qscale=8.0,
    )  # fmt: skip
    cases["fp32-bs16-gqa8-sinks"] = dict(block_size=16, ratio=8, lens=lens_for(6, 16), sinks=True)
    cases["fp16-bs8-gqa4-sinks-window20-split4-rows"] = dict(
        block_size=8, ratio=4, lens=[0, 300, 5, 129], window=20, splits=4, rows=True,
        sinks=True, dtype="float16",
    )  # fmt: skip
    # FP8 caches (--kv-cache-dtype): e4m3fn and e5m2 bytes decoded in the kernel, under fp32
    # and bf16 queries, with a window, splits, rows, a soft cap and sinks.
    cases["fp32-kv-fp8e4m3-bs16-gqa4"] = dict(
        block_size=16, ratio=4, lens=lens_for(6, 16), kv="float8_e4m3fn"
    )
    cases["bf16-kv-fp8e5m2-bs8-gqa2-window40-split4-rows"] = dict(
        block_size=8, ratio=2, lens=[0, 300, 5, 129], window=40, splits=4, rows=True,
        dtype="bfloat16", kv="float8_e5m2",
    )  # fmt: skip
    cases["fp32-kv-fp8e4m3-bs32-gqa8-sinks-softcap30"] = dict(
        block_size=32, ratio=8, lens=lens_for(3, 32), sinks=True, soft_cap=30.0,
        kv="float8_e4m3fn",
    )  # fmt: skip
    cases["fp32-bs32-gqa1-sinks-softcap5-split16-padding"] = dict(
        block_size=32, ratio=1, lens=[0, 64, 257], sinks=True, soft_cap=5.0, splits=16,
        rows=True,
    )  # fmt: skip
    return cases


CASES = _cases()
# Larger shapes for the real kernel only (the interpreter would take minutes).
GPU_CASES = {
    "bf16-llama8b-bs16": dict(
        block_size=16, ratio=4, kv_heads=8, dim=128, dtype="bfloat16", lens=[2000, 1, 640, 513]
    ),
    "fp16-llama8b-bs256-batch1": dict(
        block_size=256, ratio=4, kv_heads=8, dim=128, dtype="float16", lens=[1500]
    ),
    "bf16-batch64": dict(
        block_size=16, ratio=4, kv_heads=8, dim=128, dtype="bfloat16", lens=list(range(1, 640, 10))
    ),
}


def build_case(spec: dict, device: str, seed: int = 0) -> dict:
    """Scattered blocks; the cache is NaN everywhere no context reaches (block 0 pads the
    tables); ``out`` starts at UNTOUCHED."""
    block_size, lens = spec["block_size"], spec["lens"]
    kv_heads, dim = spec.get("kv_heads", 2), spec.get("dim", 64)
    heads, dtype = kv_heads * spec["ratio"], getattr(torch, spec.get("dtype", "float32"))
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(needs) + 2  # the null block 0, the contexts', two unused
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    table = torch.zeros(len(lens), max(needs, default=0) + 2, dtype=torch.int32)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    window = spec.get("window", 0)
    for i, (n, need) in enumerate(zip(lens, needs, strict=True)):
        table[i, :need] = torch.tensor([ids.pop() for _ in range(need)], dtype=torch.int32)
        for p in range(max(0, n - window) if window else 0, n):  # NaN before a window too
            valid[table[i, p // block_size], p % block_size] = True
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    if spec.get("kv"):  # an FP8 cache: magnitudes from 2^-12 (subnormals) to 2^4
        cache *= torch.exp2(torch.randint(-10, 3, cache.shape, generator=gen).float())
    cache[:, ~valid] = float("nan")
    num_rows = len(lens) + (3 if spec.get("rows") else 0)
    q = torch.randn(num_rows, heads, dim, generator=gen) * spec.get("qscale", 1.0)
    rows = torch.randperm(num_rows, generator=gen)[: len(lens)].int() if spec.get("rows") else None
    # Sink logits around the scores' range: some heads barely sunk, some mostly.
    sinks = torch.randn(heads, generator=gen) * 3 if spec.get("sinks") else None
    return dict(
        q=q.to(device, dtype),
        cache=cache.to(device, getattr(torch, spec["kv"]) if spec.get("kv") else dtype),
        table=table.to(device),
        lens=torch.tensor(lens, dtype=torch.int32, device=device),
        rows=None if rows is None else rows.to(device),
        out=torch.full((num_rows, heads, dim), UNTOUCHED, dtype=dtype, device=device),
        scale=dim**-0.5,
        sinks=None if sinks is None else sinks.to(device, dtype),
    )


def run_case(spec: dict, device: str) -> dict:
    """The kernel on one case: its worst error against float64, whether every output is
    finite and whether the rows no sequence owns kept their contents."""
    t = build_case(spec, device)
    args = (t["q"], t["cache"], t["table"], t["lens"], t["scale"])
    window, soft_cap = spec.get("window", 0), spec.get("soft_cap", 0.0)
    out = triton_decode.paged_decode_attention(
        *args, out=t["out"], rows=t["rows"], num_splits=spec.get("splits"), window=window,
        soft_cap=soft_cap, sinks=t["sinks"],
    )  # fmt: skip
    assert out is t["out"]
    out = out.cpu()
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in t.items()}
    ref = decode_reference(
        cpu["q"], cpu["cache"], cpu["table"], cpu["lens"], t["scale"], cpu["rows"], window,
        soft_cap, cpu["sinks"],
    )  # fmt: skip
    err = max(float((out[row].double() - r).abs().max()) for row, r in ref.items())
    others = [r for r in range(out.shape[0]) if r not in ref]
    return dict(
        max_err=err,
        finite=bool(torch.isfinite(out).all()),
        untouched=bool((out[others] == UNTOUCHED).all()) if others else True,
    )


def check_result(result: dict, spec: dict) -> None:
    assert "error" not in result, result.get("error")
    assert result["finite"], "a NaN slot past seq_len (or the null block) was read"
    assert result["untouched"], "a row no sequence owns was written"
    assert result["max_err"] <= TOLERANCE[spec.get("dtype", "float32")], result


# -- the kernel in Triton's interpreter (CPU, a child process) ---------------------------------
def interpreter_main() -> None:
    """The child: the case ids on stdin, one JSON line of results on stdout. The parent set
    TRITON_INTERPRET=1 before anything imported triton."""
    print_case_results(
        type(triton_decode._decode_kernel).__name__,
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
    # that reads the whole last block, one that writes every row, one that reads before a
    # window, one without the soft cap and one without the sinks fail them.
    def emulated(q, kv_cache, block_table, seq_lens, scale, out, rows=None, num_splits=None,
                 window=0, soft_cap=0.0, sinks=None):  # fmt: skip
        full = seq_lens if not read_past else -(-seq_lens // kv_cache.shape[2]) * kv_cache.shape[2]
        window = 0 if read_before else window
        soft_cap = 0.0 if drop_cap else soft_cap
        sinks = None if drop_sinks else sinks
        ref = decode_reference(q, kv_cache, block_table, full, scale, rows, window, soft_cap, sinks)
        for row, o in ref.items():
            out[row] = o.to(out.dtype)
        if write_all:
            out[:] = out[0 if rows is None else int(rows[0])].clone()
        return out

    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated)
    spec = CASES["fp32-bs32-gqa1-split2-rows"]
    read_past = write_all = read_before = drop_cap = drop_sinks = False
    check_result(run_case(spec, "cpu"), spec)
    read_past = True
    assert not run_case(spec, "cpu")["finite"]
    read_past, write_all = False, True
    assert not run_case(spec, "cpu")["untouched"]
    # One that reads before a sliding window.
    spec, write_all, read_before = CASES["fp32-bs8-gqa4-window40"], False, False
    check_result(run_case(spec, "cpu"), spec)
    read_before = True
    assert not run_case(spec, "cpu")["finite"]
    read_before = False
    for spec, flag in (("fp32-bs16-gqa4-softcap50", "cap"), ("fp32-bs16-gqa8-sinks", "sinks")):
        spec = CASES[spec]
        check_result(run_case(spec, "cpu"), spec)
        drop_cap, drop_sinks = flag == "cap", flag == "sinks"
        with pytest.raises(AssertionError, match="max_err"):
            check_result(run_case(spec, "cpu"), spec)
        drop_cap = drop_sinks = False


# -- the kernel on a GPU -------------------------------------------------------------------------
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("case_id", list(CASES) + list(GPU_CASES))
def test_real_kernel_matches_float64(case_id):
    spec = {**CASES, **GPU_CASES}[case_id]
    check_result(run_case(spec, "cuda"), spec)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mode", ["triton", "varlen"])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_backend_matches_float64_in_either_decode_mode(monkeypatch, mode, kind):
    monkeypatch.setenv("VLLM_CUDA_DECODE_ATTENTION", mode)
    check_against_float64(kind, torch.bfloat16, 16, False, 32, 8, "cuda")


def _decode_step(lens, block_size, num_blocks, heads, kv_heads, dim, seed, device, dtype):
    rng = random.Random(seed)
    ids = rng.sample(range(1, num_blocks), sum(-(-n // block_size) for n in lens))
    seqs = []
    for n in lens:
        need = -(-n // block_size)
        seqs.append((n - 1, 1, ids[:need]))
        ids = ids[need:]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(len(lens), h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    return seqs, *(t.to(device, dtype) for t in (q, k, v))


@pytest.mark.cuda
@needs_cuda
def test_decode_step_replays_in_a_cuda_graph(monkeypatch):
    monkeypatch.setenv("VLLM_CUDA_DECODE_ATTENTION", "triton")
    heads, kv_heads, dim, block_size, num_blocks = 32, 8, 128, 16, 400
    dtype, scale = torch.bfloat16, 128**-0.5
    backend = TorchFlashAttentionBackend(heads, kv_heads, dim, dtype, "cuda", block_size)
    shape = (heads, kv_heads, dim)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, device="cuda", dtype=dtype)
    # Captured with a table as wide as the longest context a replay may have (1024 tokens).
    seqs, q, k, v = _decode_step(
        [1024, 5, 100, 33], block_size, num_blocks, *shape, 0, "cuda", dtype
    )
    meta = backend.build_metadata(seqs)
    assert isinstance(meta, TritonDecodeMetadata) and meta.decode_rows is None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernel outside the capture
        backend.forward(q, k, v, cache, meta, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, scale)
    for seed, lens in [(1, [7, 300, 1, 129]), (2, [1024, 16, 17, 640])]:
        seqs, q1, k1, v1 = _decode_step(lens, block_size, num_blocks, *shape, seed, "cuda", dtype)
        meta.copy_(backend.build_metadata(seqs))
        for static, new in ((q, q1), (k, k1), (v, v1)):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        ref = sdpa_reference(seqs, q1, cache, scale, block_size)
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
        for i, (c, _, ids) in enumerate(seqs):  # the step's K/V went to its slots
            assert torch.equal(cache[0, ids[c // block_size], c % block_size], k1[i])
            assert torch.equal(cache[1, ids[c // block_size], c % block_size], v1[i])


# -- the dispatch, on CPU -------------------------------------------------------------------------
def emulated_kernel(calls: list):
    """``paged_decode_attention`` in float64 torch, checking the arguments the real one
    takes (int32 tables on q's device, a preallocated ``out``)."""

    def kernel(
        q, kv_cache, block_table, seq_lens, scale, out=None, rows=None, num_splits=None, window=0,
        soft_cap=0.0, sinks=None,
    ):  # fmt: skip
        assert block_table.dtype == seq_lens.dtype == torch.int32
        assert rows is None or rows.dtype == torch.int32
        tensors = [q, kv_cache, block_table, seq_lens, out] + ([] if rows is None else [rows])
        assert {t.device for t in tensors} == {q.device} and out.shape == q.shape
        calls.append(
            dict(num_seqs=len(seq_lens), rows=rows, window=window, soft_cap=soft_cap, sinks=sinks)
        )
        ref = decode_reference(
            q, kv_cache, block_table, seq_lens, scale, rows, window, soft_cap, sinks
        )
        for row, o in ref.items():
            out[row] = o.to(out.dtype)
        return out

    return kernel


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("block_size", [4, 16, 256])
def test_decode_rows_go_to_the_triton_kernel(monkeypatch, kind, block_size, window):
    varlen_calls = install(monkeypatch, ref_varlen_attn)
    decode_calls: list = []
    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated_kernel(decode_calls))
    heads, kv_heads, dim, scale = 6, 2, 8, 0.3
    seqs, q, k, v, cache = make_batch(kind, block_size, heads, kv_heads, dim, seed=block_size)
    backend = TorchFlashAttentionBackend(heads, kv_heads, dim, torch.float32, "cpu", block_size)
    assert backend.decode_kernel == "varlen"  # no CUDA here
    backend.decode_kernel = "triton"  # as on a GPU with triton

    written = cache.clone()
    meta = backend.build_metadata(seqs)
    features = {} if window is None else {"sliding_window": window}
    out = backend.forward(q, k, v, written, meta, scale, **features)
    num_decodes = sum(n == 1 for _, n, _ in seqs)
    assert [c["num_seqs"] for c in decode_calls] == ([num_decodes] if num_decodes else [])
    assert all(c["window"] == (window or 0) for c in decode_calls)
    assert len(varlen_calls) == (1 if num_decodes < len(seqs) else 0)
    ref = sdpa_reference(seqs, q, written, scale, block_size, window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # The step's K/V at the slots the varlen builder computes, nothing else changed.
    expected = cache.clone()
    slots = build_varlen_metadata(seqs, block_size, "cpu", False).slot_mapping
    assert torch.equal(meta.slot_mapping, slots)
    ops.reshape_and_cache(k, v, expected, slots)
    assert torch.equal(written, expected)


def test_triton_metadata_layout():
    # Block size 4. Decode at position 9 (blocks 5 2 7: slot 7*4+1), a 7-token prompt
    # (blocks 3 4: slots 12..18), a decode at position 3 (block 6: slot 27), a 5-token
    # chunk at 6..10 (blocks 1 8 9: slots 8*4+2, 35, 36, 37, 38).
    seqs = [(9, 1, [5, 2, 7]), (0, 7, [3, 4]), (3, 1, [6]), (6, 5, [1, 8, 9])]
    meta = build_triton_decode_metadata(seqs, 4, "cpu", paged=False)
    assert meta.block_table.tolist() == [[5, 2, 7], [6, 0, 0]]
    assert meta.seq_lens.tolist() == [10, 4]
    assert meta.decode_rows.tolist() == [0, 8]
    assert meta.prefill_rows.tolist() == [*range(1, 8), *range(9, 14)]
    assert meta.slot_mapping.tolist() == [29, *range(12, 19), 27, 34, 35, 36, 37, 38]
    assert meta.block_table.dtype == meta.seq_lens.dtype == meta.decode_rows.dtype == torch.int32
    storage = meta.slot_mapping.untyped_storage().data_ptr()
    for t in (meta.block_table, meta.seq_lens, meta.decode_rows, meta.prefill_rows):
        assert t.untyped_storage().data_ptr() == storage  # one upload
    assert meta.prefill.cu_seq_q.tolist() == [0, 7, 12]
    assert meta.prefill.seqused_k.tolist() == [7, 11]
    assert not meta.prefill.paged and meta.prefill.gather_slots.numel() == 18

    only = build_triton_decode_metadata([seqs[0], seqs[2]], 4, "cpu", paged=False)
    assert only.decode_rows is None and only.prefill is None and only.prefill_rows is None
    assert only.slot_mapping.tolist() == [29, 27]
    with pytest.raises(ValueError, match="2 blocks of 4 cannot hold 10"):
        build_triton_decode_metadata([(9, 1, [5, 2])], 4, "cpu", paged=False)


def test_a_step_without_decodes_is_built_as_before():
    backend = TorchFlashAttentionBackend(4, 2, 8, torch.float16, "cpu", 16)
    backend.decode_kernel = "triton"
    assert isinstance(backend.build_metadata([(0, 7, [1]), (6, 5, [2])]), VarlenMetadata)
    assert isinstance(backend.build_metadata([(0, 7, [1]), (6, 1, [2])]), TritonDecodeMetadata)
    backend.decode_kernel = "varlen"
    assert isinstance(backend.build_metadata([(6, 1, [2])]), VarlenMetadata)


def test_copy_takes_another_step_into_the_captured_tensors():
    wide = build_triton_decode_metadata([(40, 1, [1, 2, 3]), (3, 1, [4])], 16, "cpu", False)
    step = build_triton_decode_metadata([(5, 1, [7]), (20, 1, [8, 9])], 16, "cpu", False)
    tensors = (wide.slot_mapping, wide.block_table, wide.seq_lens)
    ptrs = [t.data_ptr() for t in tensors]
    wide.copy_(step)
    assert [t.data_ptr() for t in tensors] == ptrs  # the same buffers, new contents
    assert wide.block_table.tolist() == [[7, 0, 0], [8, 9, 0]]
    assert wide.seq_lens.tolist() == [6, 21] and wide.slot_mapping.tolist() == [117, 148]
    with pytest.raises(ValueError, match="does not fit"):
        step.copy_(build_triton_decode_metadata([(40, 1, [1, 2, 3])] * 2, 16, "cpu", False))
    mixed = build_triton_decode_metadata([(5, 1, [7]), (0, 3, [8])], 16, "cpu", False)
    with pytest.raises(ValueError, match="decode-only"):
        wide.copy_(mixed)


@pytest.mark.parametrize("features", ["none", "sinks", "soft_cap"])
def test_split_forward_on_fake_cuda_tensors(monkeypatch, features):
    # The whole forward of a mixed step on fake cuda:0 tensors, torch's own varlen_attn
    # (its fake kernel, asked for its log-sum-exp for sinks) for the prefill rows and
    # stand-ins for the Triton launches: every tensor on the device, and no device value
    # read on the host (it would raise here).
    seen = []

    def launch(q, kv_cache, block_table, seq_lens, scale, out=None, rows=None, num_splits=None,
               window=0, soft_cap=0.0, sinks=None):  # fmt: skip
        tensors = [q, kv_cache, block_table, seq_lens, out] + ([] if rows is None else [rows])
        tensors += [] if sinks is None else [sinks]
        seen.append({t.device for t in tensors})
        return out

    def prefill_launch(q, kv_cache, block_table, seq_lens, cu_seq_q, max_q, scale, out=None,
                       window=0, soft_cap=0.0, sinks=None):  # fmt: skip
        seen.append({t.device for t in (q, kv_cache, block_table, seq_lens, cu_seq_q)})
        return torch.empty_like(q)

    monkeypatch.setattr(triton_decode, "paged_decode_attention", launch)
    monkeypatch.setattr(triton_prefill, "paged_prefill_attention", prefill_launch)
    heads, kv_heads, dim, block_size, dtype = 8, 2, 64, 16, torch.bfloat16
    lens = BATCHES["mixed"]
    dev = torch.device("cuda", 0)
    with FakeTensorMode():
        backend = TorchFlashAttentionBackend(heads, kv_heads, dim, dtype, dev, block_size)
        backend.decode_kernel = "triton"
        num_blocks = sum(-(-(c + n) // block_size) for c, n in lens) + 1
        it = iter(range(1, num_blocks))
        seqs = [(c, n, [next(it) for _ in range(-(-(c + n) // block_size))]) for c, n in lens]
        meta = backend.build_metadata(seqs)
        assert isinstance(meta, TritonDecodeMetadata)
        tokens = sum(n for _, n in lens)
        q = torch.empty(tokens, heads, dim, dtype=dtype, device=dev)
        k = torch.empty(tokens, kv_heads, dim, dtype=dtype, device=dev)
        v = torch.empty(tokens, kv_heads, dim, dtype=dtype, device=dev)
        cache = torch.empty(2, num_blocks, block_size, kv_heads, dim, dtype=dtype, device=dev)
        extra = {
            "none": {},
            "sinks": {"sinks": torch.zeros(heads, dtype=dtype, device=dev)},
            "soft_cap": {"logits_soft_cap": 30.0},
        }[features]
        out = backend.forward(q, k, v, cache, meta, dim**-0.5, **extra)
        assert out.shape == q.shape and out.dtype == dtype and out.device == dev
    # The decode launch; the prefill kernel's for soft caps (varlen_attn's otherwise).
    assert seen == [{dev}] * (2 if features == "soft_cap" else 1)


# -- the choice ------------------------------------------------------------------------------------
def test_the_environment_variable_chooses(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("VLLM_CUDA_DECODE_ATTENTION", raising=False)
    assert torch_flash.choose_decode_kernel(cpu) == "varlen"  # auto: Triton on CUDA only
    monkeypatch.setenv("VLLM_CUDA_DECODE_ATTENTION", "VARLEN")
    assert torch_flash.choose_decode_kernel(cuda) == "varlen"
    monkeypatch.setenv("VLLM_CUDA_DECODE_ATTENTION", "triton")
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="VLLM_CUDA_DECODE_ATTENTION=triton: .*CUDA"):
            torch_flash.choose_decode_kernel(cuda)
        with pytest.raises(RuntimeError, match="=triton"):
            TorchFlashAttentionBackend(4, 2, 8, torch.float16, "cpu", 16)
    monkeypatch.setenv("VLLM_CUDA_DECODE_ATTENTION", "flashinfer")
    with pytest.raises(ValueError, match="VLLM_CUDA_DECODE_ATTENTION='flashinfer'"):
        torch_flash.choose_decode_kernel(cpu)


def test_auto_takes_triton_where_it_runs(monkeypatch):
    monkeypatch.delenv("VLLM_CUDA_DECODE_ATTENTION", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_decode, "triton_unavailable_reason", lambda device: None)
    assert torch_flash.choose_decode_kernel(torch.device("cuda", 0)) == "triton"
    monkeypatch.setattr(triton_decode, "triton_unavailable_reason", lambda d: "no triton (test)")
    assert torch_flash.choose_decode_kernel(torch.device("cuda", 0)) == "varlen"


def test_detail_names_the_decode_kernel(monkeypatch):
    install(monkeypatch, ref_varlen_attn)
    backend = TorchFlashAttentionBackend(4, 4, 8, torch.float16, "cpu", 16)
    assert "Triton" not in backend.detail
    backend.decode_kernel = "triton"
    assert backend.detail.startswith("decode rows: Triton paged kernel; other rows: ")


def test_splits_follow_the_batch_shape_only(monkeypatch):
    assert triton_decode.default_num_splits(1, 8, torch.device("cpu")) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_decode, "_num_sms", lambda index: 132)
    cuda = torch.device("cuda", 0)
    splits = [triton_decode.default_num_splits(n, 8, cuda) for n in (1, 2, 4, 16, 17, 256)]
    assert splits == [16, 16, 8, 2, 1, 1]  # about one program per SM, a power of two
    assert all(s & (s - 1) == 0 for s in splits)


def test_kernel_module_imports_without_triton():
    # CPU-only installs: the module imports, says why it cannot run, refuses to launch.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from vllm.v1.attention.backends import triton_decode as t\n"
        "assert t.triton_unavailable_reason(torch.device('cuda')) == 'triton is not installed'\n"
        "try:\n"
        "    t.paged_decode_attention(*[torch.zeros(1)] * 4, 1.0)\n"
        "except RuntimeError as e:\n"
        "    assert 'needs triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('launched without triton')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_decode_reference_agrees_with_the_sdpa_reference():
    # decode_reference against test_torch_flash's SDPA reference on a decode batch.
    seqs, q, _, _, cache = make_batch("decode", 16, 6, 2, 8, seed=5)
    table = torch.zeros(len(seqs), 20, dtype=torch.int32)
    for i, (_, _, ids) in enumerate(seqs):
        table[i, : len(ids)] = torch.tensor(ids)
    lens = torch.tensor([c + n for c, n, _ in seqs], dtype=torch.int32)
    ref = decode_reference(q, cache, table, lens, 0.3)
    expected = sdpa_reference(seqs, q, cache, 0.3, 16)
    torch.testing.assert_close(torch.stack([ref[i] for i in range(len(seqs))]), expected)


# -- the start-up warm-up: every variant a step can launch, compiled before requests -----------
def test_split_variants_cover_every_batch_size(monkeypatch):
    # An H200's 132 SMs, Llama-3-8B's 8 KV heads: 1-16 decodes launch 16, 8, 4 or 2 splits.
    monkeypatch.setattr(triton_decode, "_num_sms", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cuda = torch.device("cuda", 0)
    variants = triton_decode.split_variants(16, 8, cuda)
    assert variants == {16: 1, 8: 3, 4: 5, 2: 9}
    assert {triton_decode.default_num_splits(n, 8, cuda) for n in range(1, 17)} == set(variants)
    assert triton_decode.split_variants(64, 8, cuda)[1] == 17  # 136 programs fill the card


@pytest.mark.parametrize("features", [(False, False), (True, False), (False, True)])
def test_warm_up_launches_each_variant_with_and_without_rows(monkeypatch, features):
    launched = []
    soft_cap, sinks = features

    def record(q, kv_cache, block_table, seq_lens, scale, out=None, rows=None, num_splits=None,
               soft_cap=0.0, sinks=None):  # fmt: skip
        assert block_table.dtype == seq_lens.dtype == torch.int32  # the metadata's dtypes
        assert rows is None or (rows.dtype == torch.int32 and rows.shape == (q.shape[0],))
        assert q.dtype == kv_cache.dtype and q.shape[1:] == (8, 16)
        # The model's variant: capped or not, sinks of the cache's dtype or none.
        assert (soft_cap > 0) == features[0]
        assert sinks is None if not features[1] else sinks.shape == (8,)
        assert sinks is None or sinks.dtype == kv_cache.dtype
        launched.append((num_splits, q.shape[0], rows is not None))

    monkeypatch.setattr(triton_decode, "paged_decode_attention", record)
    monkeypatch.setattr(triton_decode, "default_num_splits", lambda n, h, d: 4 if n < 3 else 1)
    cache = torch.zeros(2, 3, 16, 2, 16, dtype=torch.bfloat16)
    assert triton_decode.warm_up(cache, 8, 6, soft_cap=soft_cap, sinks=sinks) == 4
    assert launched == [(4, 1, False), (4, 1, True), (1, 3, False), (1, 3, True)]


def test_the_backend_warms_the_triton_decode_kernel_only(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_decode, "warm_up", lambda *a, **kw: calls.append((a, kw)) or 7)
    backend = TorchFlashAttentionBackend(8, 2, 16, torch.float32, "cpu", 16)
    cache = [torch.zeros(2, 3, 16, 2, 16)]
    assert backend.decode_kernel != "triton" and backend.warm_up(cache, 4) == 0
    backend.decode_kernel = "triton"
    assert backend.warm_up(cache, 4) == 7
    assert calls == [((cache[0], 8, 4), {"soft_cap": False, "sinks": False})]
    backend.model_features = frozenset({"sinks", "sliding_window"})  # as the runner sets it
    backend.warm_up(cache, 4)
    assert calls[-1][1] == {"soft_cap": False, "sinks": True}
    assert backend.warm_up([], 4) == 0


def _compiled(fn) -> int:
    """How many variants of Triton kernel ``fn`` are compiled (in this process)."""
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(entry[0]) for entry in caches.values())
    return sum(len(c) for c in fn.cache.values())


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("features", ["none", "soft_cap+sinks"])
def test_after_the_warm_up_no_decode_step_compiles_a_kernel(features):
    # Mixed steps (query rows), decode-only eager steps, 1 to 16 decodes, block tables of
    # 1 to 33 blocks: every launch finds its kernel compiled by ``warm_up`` (a Gemma 2- or
    # gpt-oss-like layer's too: soft-capped, with bf16 sinks).
    heads, kv_heads, dim, block_size = 32, 8, 128, 16
    cache = torch.zeros(2, 80, block_size, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    both = features != "none"
    triton_decode.warm_up(cache, heads, 16, soft_cap=both, sinks=both)
    extra = {}
    if both:
        sinks = torch.randn(heads, dtype=torch.bfloat16, device="cuda")
        extra = {"soft_cap": 50.0, "sinks": sinks}
    before = (
        _compiled(triton_decode._decode_kernel),
        _compiled(triton_decode._combine_splits_kernel),
    )
    for n in range(1, 17):
        for width in (1, 3, 16, 33):
            q = torch.randn(n + 5, heads, dim, dtype=torch.bfloat16, device="cuda")
            table = torch.randint(1, 80, (n, width), dtype=torch.int32, device="cuda")
            lens = torch.full((n,), width * block_size, dtype=torch.int32, device="cuda")
            rows = torch.arange(5, n + 5, dtype=torch.int32, device="cuda")
            triton_decode.paged_decode_attention(q, cache, table, lens, 0.1, rows=rows, **extra)
            triton_decode.paged_decode_attention(
                q[:n].contiguous(), cache, table, lens, 0.1, **extra
            )
    torch.cuda.synchronize()
    after = (
        _compiled(triton_decode._decode_kernel),
        _compiled(triton_decode._combine_splits_kernel),
    )
    assert after == before
    # The count does count variants: fp32 at a head size no other test launches (one for
    # each case: an earlier test in the process may have compiled any common variant).
    odd_dim = 40 if both else 56
    f32 = torch.zeros(2, 4, block_size, kv_heads, odd_dim, device="cuda")
    q32 = torch.randn(1, heads, odd_dim, device="cuda")
    triton_decode.paged_decode_attention(q32, f32, table[:1, :1] % 4, lens[:1] * 0 + 1, 0.1)
    assert _compiled(triton_decode._decode_kernel) > after[0]
