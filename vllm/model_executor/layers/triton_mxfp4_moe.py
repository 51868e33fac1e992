"""A grouped GEMM over MXFP4 expert weights in Triton, for gpt-oss's experts kept packed.

``mxfp4_grouped_linear(x, blocks, scales, expert_ends, bias)``: the rows of ``x`` are
sorted by expert, expert ``e`` owning rows ``[expert_ends[e - 1], expert_ends[e])``, and
each row becomes ``x[row] @ W_e^T (+ bias[e])``. ``W_e (N, K)`` stays as the checkpoint
stores it, in MXFP4::

    blocks  (E, N, K / 32, 16) uint8   two E2M1 codes a byte, value 2j the low nibble
    scales  (E, N, K / 32)     uint8   E8M0: each group of 32 values times 2^(s - 127)

and is expanded in registers, tile by tile, never in memory: a code's value is the E2M1
table's (sign, 2-bit exponent, 1-bit mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6) times its
group's power of two, both exact in fp32.

One program per (tile of ``BLOCK_M`` sorted rows, tile of ``BLOCK_N`` output columns). A
row tile may hold the tail of one expert and the head of the next: the program finds the
experts its rows span from ``expert_ends`` (on the device) and walks them, each one's
products masked to its own rows, so every row is computed once and with its expert only.
The grid depends on ``(rows, N)`` alone and nothing is read on the host, so a decode step
runs in a captured CUDA graph and replays with other routings written into the same
tensors.

``x`` is fp32, fp16 or bf16; products and sums are fp32 and the output is ``x``'s dtype.
fp16/bf16 tiles are widened to fp32 and multiplied at TF32 input precision, which holds
their mantissas and every MXFP4 value exactly; fp32 inputs multiply at IEEE precision. The
Triton interpreter (numpy) cannot multiply bf16 tiles, so widening also lets the CPU tests
cover bf16. Each K step splits the tile's columns into the even ones (low nibbles) and the
odd ones (high nibbles): two products of ``BLOCK_K / 2``, with no interleaving in
registers.

Triton is optional: without it this module imports (``triton_unavailable_reason`` says why
it cannot run). Tests run the kernel on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.triton_gemm import default_block_m as shared_block_m
from vllm.model_executor.layers.triton_gemm import (
    gemm_unavailable_reason,
    start_gemm,
    tile_experts,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: gpt-oss's experts are expanded at load instead
    triton = None
    tl = None

MXFP4_GROUP = 32  # values per E8M0 scale
BLOCK_N = 64
BLOCK_K = 64  # two scale groups a step: 32 even and 32 odd columns
KERNEL = "MXFP4 kernel"
BLOCK_K_SIZES = (32, 64, 128, 256)  # whole scale groups, at least tl.dot's K of 16 a half


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can; ``gemm_unavailable_reason``)."""
    return gemm_unavailable_reason(device, KERNEL)


def default_block_m(num_rows: int) -> int:
    """Rows a program takes (``triton_gemm.default_block_m``, decode-sized up to 256)."""
    return shared_block_m(num_rows, 256)


def check_mxfp4_args(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    expert_ends: torch.Tensor,
    bias: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or device does not fit."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be 2-d fp32/fp16/bf16, got {tuple(x.shape)} {x.dtype}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"blocks must be (E, N, K / 32, 16), got {tuple(blocks.shape)}")
    if scales.shape != blocks.shape[:-1]:
        raise ValueError(f"scales {tuple(scales.shape)} do not fit blocks {tuple(blocks.shape)}")
    num_experts, n, groups = scales.shape
    if x.shape[1] != groups * MXFP4_GROUP:
        raise ValueError(f"x has {x.shape[1]} columns, the weights {groups * MXFP4_GROUP}")
    if not (blocks.is_contiguous() and scales.is_contiguous()):
        raise ValueError("blocks and scales must be contiguous")
    if expert_ends.shape != (num_experts,) or expert_ends.dtype != torch.int32:
        raise ValueError(
            f"expert_ends must be ({num_experts},) int32, got "
            f"{tuple(expert_ends.shape)} {expert_ends.dtype}"
        )
    if bias is not None and bias.shape != (num_experts, n):
        raise ValueError(f"bias must be ({num_experts}, {n}), got {tuple(bias.shape)}")
    tensors = (blocks, scales, expert_ends) + (() if bias is None else (bias,))
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, blocks, scales, expert_ends and bias must share a device")


def mxfp4_grouped_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    expert_ends: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """``(rows, N)`` in ``x``'s dtype: row ``r`` of ``x (rows, K)`` times ``W_e^T`` (plus
    ``bias[e]``), ``e`` the expert whose range ``[expert_ends[e - 1], expert_ends[e])``
    holds ``r`` (``expert_ends`` int32, non-decreasing, on the device; rows past its last
    entry get zeros). The launch depends on the shapes only. The tile sizes default to
    ``default_block_m``, ``BLOCK_N`` and ``BLOCK_K`` (unmeasured on a GPU: to be tuned)."""
    check_mxfp4_args(x, blocks, scales, expert_ends, bias)
    block_m = block_m or default_block_m(x.shape[0])
    num_experts, n, groups = scales.shape
    rows = x.shape[0]
    tiles = (block_m, block_n, block_k)
    out, grid = start_gemm("mxfp4_grouped_linear", KERNEL, x, n, tiles, BLOCK_K_SIZES)
    if grid is None:
        return out
    _mxfp4_grouped_kernel[grid](
        x, blocks, scales, expert_ends, x if bias is None else bias, out,
        rows, n, groups * MXFP4_GROUP, num_experts, x.stride(0), x.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=triton.next_power_of_2(num_experts), HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _e2m1_values(code):
        """fp32 values of 4-bit E2M1 codes (int32 0-15): sign, 2-bit exponent, mantissa."""
        exponent = (code >> 1) & 3
        mantissa = (code & 1).to(tl.float32)
        # exponent 0: 0 or 0.5 (subnormal); else (1 + m / 2) * 2^(exponent - 1)
        normal = (2.0 + mantissa) * (1 << exponent).to(tl.float32) * 0.25
        magnitude = tl.where(exponent == 0, mantissa * 0.5, normal)
        return tl.where((code & 8) != 0, -magnitude, magnitude)

    @triton.jit
    def _e8m0_values(scale):
        """fp32 ``2^(scale - 127)`` of E8M0 exponents (int32 0-255), exactly: the bits of an
        fp32 with that exponent field (scale 0: the subnormal 2^-127; 255: inf)."""
        bits = tl.where(scale == 0, 1 << 22, scale << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit(do_not_specialize=["num_rows"])  # one compile for every batch's rows
    def _mxfp4_grouped_kernel(
        x_ptr, blocks_ptr, scales_ptr, ends_ptr, bias_ptr, out_ptr,
        num_rows, N, K, num_experts, stride_xm, stride_xk, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        HALF_K: tl.constexpr = BLOCK_K // 2
        first_row = tl.program_id(0) * BLOCK_M
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        pairs = tl.arange(0, HALF_K)  # byte j of a step: columns 2j (low) and 2j + 1 (high)
        first_expert, last_expert = tile_experts(
            ends_ptr, first_row, num_rows, num_experts, BLOCK_M, BLOCK_E
        )
        x_rows = rows.to(tl.int64) * stride_xm  # int64: rows * K may pass 2^31 in a prefill
        half_k = K // 2
        groups = K // 32
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for e in range(first_expert, last_expert + 1):
            start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
            end = tl.load(ends_ptr + e)
            if end > start:
                in_expert = (rows >= start) & (rows < tl.minimum(end, num_rows))
                # Row of W_e in the stacked (E * N) rows; int64 offsets past it (120B: 1e9 bytes)
                w_rows = cols.to(tl.int64) + e * N
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    pair = k0 // 2 + pairs
                    k_mask = pair < half_k
                    x_mask = in_expert[:, None] & k_mask[None, :]
                    x_even = x_ptr + x_rows[:, None] + (2 * pair)[None, :] * stride_xk
                    xe = tl.load(x_even, mask=x_mask, other=0.0).to(tl.float32)
                    xo = tl.load(x_even + stride_xk, mask=x_mask, other=0.0).to(tl.float32)
                    w_mask = col_mask[:, None] & k_mask[None, :]
                    byte_off = w_rows[:, None] * half_k + pair[None, :]
                    byte = tl.load(blocks_ptr + byte_off, mask=w_mask, other=0).to(tl.int32)
                    scale_off = w_rows[:, None] * groups + (pair // 16)[None, :]
                    s = tl.load(scales_ptr + scale_off, mask=w_mask, other=127).to(tl.int32)
                    scale = _e8m0_values(s)
                    w_low = _e2m1_values(byte & 15) * scale  # (BLOCK_N, HALF_K): columns 2j
                    w_high = _e2m1_values(byte >> 4) * scale  # columns 2j + 1
                    part += tl.dot(xe, tl.trans(w_low), input_precision=PRECISION)
                    part += tl.dot(xo, tl.trans(w_high), input_precision=PRECISION)
                if HAS_BIAS:
                    b = tl.load(bias_ptr + e * N + cols, mask=col_mask, other=0.0)
                    part += b.to(tl.float32)[None, :]
                # Rows of other experts multiplied zeros: keep only this expert's rows.
                acc = tl.where(in_expert[:, None], part, acc)
        out = out_ptr + (rows.to(tl.int64) * stride_om)[:, None] + cols[None, :]
        out_mask = (rows < num_rows)[:, None] & col_mask[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
