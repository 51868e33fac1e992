"""A W4A16 GEMM in Triton: 16-bit (or fp32) activations times 4-bit integer weights kept
packed, for AWQ, GPTQ and compressed-tensors int4 checkpoints (``quantization/int4.py``).

``w4a16_linear(x, qweight, scales, zeros, group_size)``: ``x (M, K) @ W (K, N)``, where
``W`` is read from one layout, whichever the checkpoint's (repacked at load)::

    qweight (K / 8, N) int32   eight 4-bit values a word along K, value k % 8 from bit 4(k % 8)
    scales  (G, N)     fp32    G = ceil(K / group_size)
    zeros   (G, N)     uint8   unsigned, so W[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]

with ``g = k // group_size``. The weight is expanded in registers, tile by tile: each
``(BLOCK_K, BLOCK_N)`` tile loads its words (one per 8 rows; the repeats hit the cache),
shifts out its nibbles, subtracts the zeros and multiplies the scales in fp32 (exact: a
small integer times a checkpoint's fp16 scale), then rounds the weight once to ``x``'s
dtype, as a model of the dequantized weights holds it. Products accumulate in fp32 and the
output is ``x``'s dtype. ``WIDEN`` (fp32 inputs, and the interpreter, which cannot multiply
bf16 tiles) multiplies fp32 tiles at IEEE precision; on a GPU 16-bit tiles go to the tensor
cores as they are. The scale and zero of each row come from its group (a gather along the
tile's K rows), so any group size, a partial last group and ``K`` or ``N`` not multiples of
the tiles are all one path.

One program per (``BLOCK_M`` rows, ``BLOCK_N`` columns); the grid depends on the shapes
only and nothing is read on the host, so decode steps stay capturable in CUDA graphs.

``w4a16_grouped_linear(x, qweight, scales, zeros, group_size, expert_ends)`` is the same
product over a MoE layer's stacked 4-bit experts (``qweight (E, K / 8, N)``, ``scales`` and
``zeros (E, G, N)``: each expert in the layout above), the rows of ``x`` sorted by expert
(expert ``e`` owning rows ``[expert_ends[e - 1], expert_ends[e])``), as
``triton_fp8_gemm.fp8_grouped_linear`` does for FP8: a row tile walks the experts its rows
span (read from ``expert_ends`` on the device), each one's products kept for its own rows;
the tile product is the dense kernel's.
Triton is optional: without it this module imports (``triton_unavailable_reason``). Tests
run the kernel on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` set before
this module is imported).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.triton_gemm import (
    TILE_SIZES,
    gemm_unavailable_reason,
    start_gemm,
    tile_experts,
)
from vllm.model_executor.layers.triton_gemm import default_block_m as shared_block_m

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the weights are dequantized at load instead
    triton = None
    tl = None

PACK = 8  # 4-bit values per int32 word
BLOCK_N = 64
BLOCK_K = 64
KERNEL = "W4A16 kernel"  # its block_m / block_n / block_k: any of TILE_SIZES


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can; ``gemm_unavailable_reason``)."""
    return gemm_unavailable_reason(device, KERNEL)


def default_block_m(num_rows: int) -> int:
    """Rows a program takes (``triton_gemm.default_block_m``, decode-sized up to 64)."""
    return shared_block_m(num_rows, 64)


def check_w4a16_args(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or device does not fit."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be 2-d fp32/fp16/bf16, got {tuple(x.shape)} {x.dtype}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-d int32, got {qweight.dtype}")
    k, n = qweight.shape[0] * PACK, qweight.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, qweight packs {k} rows")
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, got {group_size}")
    groups = -(-k // group_size)
    if scales.shape != (groups, n) or scales.dtype != torch.float32:
        raise ValueError(f"scales must be ({groups}, {n}) fp32, got {tuple(scales.shape)}")
    if zeros.shape != (groups, n) or zeros.dtype != torch.uint8:
        raise ValueError(f"zeros must be ({groups}, {n}) uint8, got {tuple(zeros.shape)}")
    if not all(t.is_contiguous() for t in (qweight, scales, zeros)):
        raise ValueError("qweight, scales and zeros must be contiguous")
    if any(t.device != x.device for t in (qweight, scales, zeros)):
        raise ValueError("x, qweight, scales and zeros must share a device")


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """``(M, N)`` in ``x``'s dtype: ``x (M, K)`` times the weight the module docstring
    describes. The tile sizes default to ``default_block_m``, ``BLOCK_N`` and ``BLOCK_K``
    (unmeasured on a GPU: to be tuned)."""
    check_w4a16_args(x, qweight, scales, zeros, group_size)
    block_m = block_m or default_block_m(x.shape[0])
    m, n, k = x.shape[0], qweight.shape[1], x.shape[1]
    tiles = (block_m, block_n, block_k)
    out, grid = start_gemm("w4a16_linear", KERNEL, x, n, tiles, TILE_SIZES)
    if grid is None:
        return out
    interpreted = x.device.type == "cpu"
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, out, m, n, k, group_size,
        x.stride(0), x.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        WIDEN=interpreted or x.dtype == torch.float32,
    )  # fmt: skip
    return out


def check_w4a16_grouped_args(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    expert_ends: torch.Tensor,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or device does not fit:
    ``qweight (E, K / 8, N)``, ``scales`` / ``zeros (E, G, N)``, ``expert_ends (E,)``."""
    if qweight.dim() != 3 or scales.dim() != 3 or zeros.dim() != 3:
        raise ValueError("qweight, scales and zeros must be 3-d (one per expert)")
    num_experts = qweight.shape[0]
    if scales.shape[0] != num_experts or zeros.shape[0] != num_experts:
        raise ValueError(f"scales and zeros must hold {num_experts} experts, as qweight")
    if x.dim() == 2 and x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous")
    check_w4a16_args(x, qweight[0], scales[0], zeros[0], group_size)
    if expert_ends.shape != (num_experts,) or expert_ends.dtype != torch.int32:
        raise ValueError(
            f"expert_ends must be ({num_experts},) int32, got "
            f"{tuple(expert_ends.shape)} {expert_ends.dtype}"
        )
    if expert_ends.device != x.device:
        raise ValueError("x and expert_ends must share a device")


def w4a16_grouped_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    expert_ends: torch.Tensor,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """``(rows, N)`` in ``x``'s dtype: row ``r`` of ``x (rows, K)`` times expert ``e``'s
    weight (``qweight[e]``, ``scales[e]``, ``zeros[e]`` in the module docstring's layout),
    ``e`` the expert whose range ``[expert_ends[e - 1], expert_ends[e])`` holds ``r``
    (``expert_ends`` int32, non-decreasing, on the device; rows past its last entry get
    zeros). The launch depends on the shapes only."""
    check_w4a16_grouped_args(x, qweight, scales, zeros, group_size, expert_ends)
    block_m = block_m or default_block_m(x.shape[0])
    num_experts, _, n = qweight.shape
    rows, k = x.shape
    tiles = (block_m, block_n, block_k)
    out, grid = start_gemm("w4a16_grouped_linear", KERNEL, x, n, tiles, TILE_SIZES)
    if grid is None:
        return out
    _w4a16_grouped_kernel[grid](
        x, qweight, scales, zeros, expert_ends, out,
        rows, n, k, scales.shape[1], group_size, num_experts, x.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        WIDEN=x.device.type == "cpu" or x.dtype == torch.float32,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _w4a16_tile_product(
        x_ptr, x_rows, x_mask_rows, qw_ptr, scales_ptr, zeros_ptr, cols, col_mask,
        N, K, group_size, stride_xk,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        WIDEN: tl.constexpr,
    ):  # fmt: skip
        """fp32 ``(BLOCK_M, BLOCK_N)``: the rows ``x_rows`` (offsets; ``x_mask_rows``) of
        ``x`` times the columns ``cols`` of one packed weight (``qw_ptr``, ``scales_ptr``
        and ``zeros_ptr`` at its first word, scale and zero), expanded tile by tile."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_mask = k < K
            a = tl.load(
                x_ptr + x_rows[:, None] + (k * stride_xk)[None, :],
                mask=x_mask_rows[:, None] & k_mask[None, :],
                other=0.0,
            )
            w_mask = k_mask[:, None] & col_mask[None, :]
            word_off = (k // 8).to(tl.int64)[:, None] * N + cols[None, :]
            words = tl.load(qw_ptr + word_off, mask=w_mask, other=0)
            q = (words >> ((k % 8) * 4)[:, None]) & 15
            group_off = (k // group_size).to(tl.int64)[:, None] * N + cols[None, :]
            s = tl.load(scales_ptr + group_off, mask=w_mask, other=0.0)
            z = tl.load(zeros_ptr + group_off, mask=w_mask, other=0).to(tl.int32)
            w = ((q - z).to(tl.float32) * s).to(x_ptr.dtype.element_ty)  # (BLOCK_K, BLOCK_N)
            if WIDEN:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        return acc

    @triton.jit(do_not_specialize=["M"])  # one compile for every batch's rows
    def _w4a16_kernel(
        x_ptr, qw_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K, group_size,
        stride_xm, stride_xk, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        WIDEN: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < M
        col_mask = cols < N
        acc = _w4a16_tile_product(
            x_ptr, rows.to(tl.int64) * stride_xm, row_mask, qw_ptr, scales_ptr, zeros_ptr,
            cols, col_mask, N, K, group_size, stride_xk, BLOCK_M, BLOCK_N, BLOCK_K, WIDEN,
        )  # fmt: skip
        out = out_ptr + (rows.to(tl.int64) * stride_om)[:, None] + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit(do_not_specialize=["num_rows"])  # one compile for every batch's rows
    def _w4a16_grouped_kernel(
        x_ptr, qw_ptr, scales_ptr, zeros_ptr, ends_ptr, out_ptr,
        num_rows, N, K, num_groups, group_size, num_experts, stride_xm, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr, WIDEN: tl.constexpr,
    ):  # fmt: skip
        first_row = tl.program_id(0) * BLOCK_M
        rows = first_row + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        first_expert, last_expert = tile_experts(
            ends_ptr, first_row, num_rows, num_experts, BLOCK_M, BLOCK_E
        )
        x_rows = rows.to(tl.int64) * stride_xm
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for e in range(first_expert, last_expert + 1):
            start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
            end = tl.load(ends_ptr + e)
            if end > start:
                in_expert = (rows >= start) & (rows < tl.minimum(end, num_rows))
                e64 = tl.cast(e, tl.int64)  # the stacked experts may pass 2^31 elements
                part = _w4a16_tile_product(
                    x_ptr, x_rows, in_expert, qw_ptr + e64 * (K // 8) * N,
                    scales_ptr + e64 * num_groups * N, zeros_ptr + e64 * num_groups * N,
                    cols, col_mask, N, K, group_size, 1, BLOCK_M, BLOCK_N, BLOCK_K, WIDEN,
                )  # fmt: skip
                # Rows of other experts loaded zeros (in_expert masks x): their sums are 0.
                acc += part
        out = out_ptr + (rows.to(tl.int64) * stride_om)[:, None] + cols[None, :]
        out_mask = (rows < num_rows)[:, None] & col_mask[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
