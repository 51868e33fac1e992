"""Top-p's nucleus edge without sorting: a Triton search over the probabilities' bits.

``sampler.apply_top_p`` keeps every token whose probability is at least the nucleus's
last one, the *edge*: the fewest most likely tokens whose float64 mass reaches ``top_p``.
On a device the sampler finds it with ``torch.sort`` of each row (values and token ids: a
segmented radix sort of 32M pairs for 256 rows of Llama-3's 128k vocabulary), then a
float64 running sum.

The edge is also the smallest probability ``v`` of the row whose *mass above it* (the
sum of the probabilities greater than ``v``) is below ``top_p``: that mass only falls as
``v`` grows, and ties go together. Non-negative float32 values order as their bit
patterns do, so the edge's bits are found by a search over integers: each pass sums, in
one read of the row, the mass above each of ``THRESHOLDS`` evenly spaced bit patterns of
the interval still open, and keeps the piece where the mass crosses ``top_p``; 8 passes
of 16 narrow 2^31 patterns to one. Nothing is read back to the host and the launches
depend on shapes only (a deferred step or a CUDA graph can hold them).

A row is split over ``splits`` programs; each writes its piece's float64 sums to a
scratch buffer, and every program of the next pass adds them in the same order, so the
result does not depend on scheduling. The sums are float64 (the sort path's running sum
is too), in another order than the sort's: the two ways can differ only for a row whose
mass lands within float64 rounding of ``top_p`` at its edge.

Not the default: to be timed against ``torch.sort`` on a GPU first
(``benchmarks/benchmark_sampler.py --top-p-ab``; docs/gpu.md). Tests run the kernels on
CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` before this module is
imported).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs without triton: the sort path only
    triton = None
    tl = None

THRESHOLDS = 16  # bit patterns tried per pass: 16^8 = 2^32 >= the 2^31 to search
PASSES = 8
BLOCK = 256  # elements a program reads at a time: a (256, 16) float64 tile, 32 a thread


def available() -> bool:
    return triton is not None


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (CPU tensors: the tests)."""
    return triton is not None and type(_top_p_pass).__name__ == "InterpretedFunction"


if triton is not None:

    @triton.jit
    def _narrow(state_ptr, parts_ptr, top_p, row, num_rows, splits,
                PASS: tl.constexpr, T: tl.constexpr):  # fmt: skip
        """(lo, hi) of pass PASS for ``row``: the open interval of bit patterns where the
        edge lies (the mass above ``hi`` is below top_p, above ``lo`` it is not; lo = -1
        at first), from pass PASS - 1's interval and summed pieces."""
        if PASS == 0:
            lo = -1
            hi = 0x7F800000  # +inf's bits: the mass above it is 0, below any top_p > 0
        else:
            base = ((PASS - 1) * num_rows + row) * 2
            lo = tl.load(state_ptr + base)
            hi = tl.load(state_ptr + base + 1)
            step = (hi - lo + T - 1) // T
            ks = tl.arange(0, T)
            mass = tl.zeros([T], dtype=tl.float64)
            for s in range(0, splits):  # the same order in every program: one result
                offs = (((PASS - 1) * num_rows + row) * splits + s) * T + ks
                mass += tl.load(parts_ptr + offs)
            cand = tl.minimum(lo + (ks + 1) * step, hi)
            below = mass < top_p  # true from some k on (cand[T-1] == hi is true)
            first = tl.min(tl.where(below, ks, T))
            new_hi = tl.min(tl.where(ks == first, cand, hi))
            new_lo = tl.max(tl.where(ks == first - 1, cand, lo))
            lo = new_lo
            hi = new_hi
        return lo, hi

    @triton.jit
    def _top_p_pass(probs_ptr, stride, top_p_ptr, state_ptr, parts_ptr, vocab, chunk,
                    num_rows, splits, PASS: tl.constexpr, T: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        piece = tl.program_id(1)
        top_p = tl.load(top_p_ptr + row)
        lo, hi = _narrow(state_ptr, parts_ptr, top_p, row, num_rows, splits, PASS, T)
        if piece == 0:
            base = (PASS * num_rows + row) * 2
            tl.store(state_ptr + base, lo)
            tl.store(state_ptr + base + 1, hi)
        step = (hi - lo + T - 1) // T
        ks = tl.arange(0, T)
        cand = tl.minimum(lo + (ks + 1) * step, hi)
        mass = tl.zeros([T], dtype=tl.float64)
        start = piece * chunk
        for off in range(start, tl.minimum(start + chunk, vocab), BLOCK):
            idx = off + tl.arange(0, BLOCK)
            ok = idx < tl.minimum(start + chunk, vocab)
            x = tl.load(probs_ptr + row * stride + idx, mask=ok, other=0.0)
            bits = x.to(tl.int32, bitcast=True)
            above = (bits[:, None] > cand[None, :]) & ok[:, None]
            mass += tl.sum(tl.where(above, x.to(tl.float64)[:, None], 0.0), axis=0)
        tl.store(parts_ptr + ((PASS * num_rows + row) * splits + piece) * T + ks, mass)

    @triton.jit
    def _top_p_edge(top_p_ptr, state_ptr, parts_ptr, edge_ptr, num_rows, splits,
                    PASS: tl.constexpr, T: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        top_p = tl.load(top_p_ptr + row)
        lo, hi = _narrow(state_ptr, parts_ptr, top_p, row, num_rows, splits, PASS, T)
        edge = hi.to(tl.float32, bitcast=True)
        keep_all = (top_p == float("inf")) | (hi <= 0)
        tl.store(edge_ptr + row, tl.where(keep_all, 0.0, edge))


def nucleus_edge(
    probs: torch.Tensor, top_p: torch.Tensor, splits: int | None = None
) -> torch.Tensor:
    """Each row's edge (float32; 0: keep every token) for ``probs`` (rows, vocab) float32
    and ``top_p`` (rows,) float64 in (0, 1], inf for a row without top-p: ``probs <
    edge`` masks the tokens ``sampler._nucleus_edge``'s edge masks. ``splits``: programs
    per row (None: enough for the device's multiprocessors)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if probs.dim() != 2 or probs.dtype != torch.float32 or probs.stride(-1) != 1:
        raise ValueError(f"probs must be (rows, vocab) float32, contiguous rows, got "
                         f"{tuple(probs.shape)} {probs.dtype}")  # fmt: skip
    rows, vocab = probs.shape
    top_p = top_p.to(device=probs.device, dtype=torch.float64).contiguous()
    edge = torch.zeros(rows, dtype=torch.float32, device=probs.device)
    if not rows:
        return edge
    if splits is None:
        units = 4
        if probs.device.type == "cuda":
            units = torch.cuda.get_device_properties(probs.device).multi_processor_count
        splits = max(1, min(-(-2 * units // rows), -(-vocab // (8 * BLOCK))))
    chunk = -(-vocab // splits)
    chunk = -(-chunk // BLOCK) * BLOCK
    splits = -(-vocab // chunk)
    state = torch.empty((PASSES, rows, 2), dtype=torch.int32, device=probs.device)
    parts = torch.empty((PASSES, rows, splits, THRESHOLDS), dtype=torch.float64,
                        device=probs.device)  # fmt: skip
    for p in range(PASSES):
        _top_p_pass[(rows, splits)](
            probs, probs.stride(0), top_p, state, parts, vocab, chunk, rows, splits,
            PASS=p, T=THRESHOLDS, BLOCK=BLOCK,
        )  # fmt: skip
    _top_p_edge[(rows,)](top_p, state, parts, edge, rows, splits, PASS=PASSES, T=THRESHOLDS)
    return edge
