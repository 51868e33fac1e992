"""A block-scaled FP8 GEMM in Triton, for FP8 checkpoints kept in FP8 on CUDA (W8A16).

``fp8_block_linear(x, weight, scale, block_size, bias)`` is ``x @ W^T (+ bias)`` with ``W
(N, K)`` as block-wise FP8 checkpoints store it (DeepSeek-V3, Qwen3-*-FP8)::

    weight  (N, K)                       float8_e4m3fn, read as its bytes (uint8)
    scale   (ceil(N / b0), ceil(K / b1)) fp32, multiplying each (b0, b1) block

Weight-only: ``x`` stays in the model's dtype. Each program decodes its weight tile's
e4m3fn bits in registers (sign, 4-bit exponent of bias 7, 3-bit mantissa; exponent 0 is
subnormal, m x 2^-9), exactly as ``triton_decode.kv_values`` does, so the kernel runs in
Triton's interpreter as on any GPU (no FP8 type needed: Ampere too). Every e4m3fn value is
exact in fp16 and bf16, so on CUDA a 16-bit ``x`` multiplies the decoded tile in its own
dtype (``tl.dot`` accumulating in fp32: the products are exact); fp32 ``x``, and every
``x`` in the interpreter (numpy has no bf16 product), multiplies widened to fp32 at IEEE
precision. A K step never crosses a scale block (``block_k`` divides ``b1``), so each
step's partial sums are multiplied by their column's block scale in fp32 and added to an
fp32 accumulator; one rounding to ``x``'s dtype at the store.

One program per (tile of ``block_m`` rows, tile of ``block_n`` output columns): the grid
depends on the shapes only and nothing is read on the host, so decode steps replay in CUDA
graphs.

``fp8_grouped_linear(x, weight, scale, block_size, expert_ends)`` is the same product over
a MoE layer's stacked FP8 experts ``weight (E, N, K)``, the rows of ``x`` sorted by expert
(expert ``e`` owning rows ``[expert_ends[e - 1], expert_ends[e])``), as
``triton_mxfp4_moe.py`` does for MXFP4: a row tile walks the experts its rows span (read
from ``expert_ends`` on the device), each one's products kept for its own rows. Scales per
block ``(E, ceil(N / b0), ceil(K / b1))`` or, with ``block_size=None``, per row
``(E, N, 1)`` (per-tensor and per-channel checkpoints).

Triton is optional: without it this module imports (``triton_unavailable_reason`` says why
the kernels cannot run); tests run them on CPU tensors in Triton's interpreter
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
except ImportError:  # CPU-only installs: block-scaled checkpoints are dequantized at load
    triton = None
    tl = None

BLOCK_N = 64
KERNEL = "FP8 GEMM"
BLOCK_K_SIZES = (128, 64, 32, 16)  # the largest dividing b1 is the default; 16: tl.dot's least


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can; ``gemm_unavailable_reason``)."""
    return gemm_unavailable_reason(device, KERNEL)


def default_block_k(block_size: tuple[int, int]) -> int | None:
    """The K step for ``block_size``: the largest of ``BLOCK_K_SIZES`` dividing its columns
    (None: none does, and the kernel cannot take these blocks)."""
    return next((k for k in BLOCK_K_SIZES if block_size[1] % k == 0), None)


def default_block_m(num_rows: int) -> int:
    """Rows a program takes (``triton_gemm.default_block_m``, decode-sized up to 256)."""
    return shared_block_m(num_rows, 256)


def check_fp8_block_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or device does not fit."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be 2-d fp32/fp16/bf16, got {tuple(x.shape)} {x.dtype}")
    if weight.dim() != 2 or weight.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"weight must be 2-d float8_e4m3fn, got {weight.dtype}")
    if not weight.is_contiguous() or not scale.is_contiguous() or x.stride(1) != 1:
        raise ValueError("weight, scale and x's rows must be contiguous")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k}")
    b0, b1 = block_size
    expected = (-(-n // b0), -(-k // b1))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise ValueError(
            f"scale must be fp32 {expected} for {(n, k)} in {list(block_size)} blocks, got "
            f"{scale.dtype} {tuple(scale.shape)}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be ({n},), got {tuple(bias.shape)}")
    tensors = (weight, scale) + (() if bias is None else (bias,))
    if any(t.device != x.device for t in tensors):
        raise ValueError("x, weight, scale and bias must share a device")


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int],
    bias: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int | None = None,
) -> torch.Tensor:
    """``(rows, N)`` in ``x``'s dtype: ``x (rows, K) @ (weight * scale per block)^T (+ bias)``.
    The launch depends on the shapes only. Tiles default to ``default_block_m``, ``BLOCK_N``
    and ``default_block_k`` (unmeasured on a GPU: to be tuned)."""
    check_fp8_block_args(x, weight, scale, block_size, bias)
    block_m = block_m or default_block_m(x.shape[0])
    block_k = block_k or default_block_k(block_size)
    rows, (n, k) = x.shape[0], weight.shape
    tiles = (block_m, block_n, block_k)
    out, grid = start_gemm("fp8_block_linear", KERNEL, x, n, tiles, BLOCK_K_SIZES, block_size[1])
    if grid is None:
        return out
    widen = x.dtype == torch.float32 or not x.is_cuda
    _fp8_block_gemm_kernel[grid](
        x, weight.view(torch.uint8), scale, x if bias is None else bias, out,
        rows, n, k, x.stride(0), out.stride(0),
        B0=block_size[0], B1=block_size[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, WIDEN=widen,
    )  # fmt: skip
    return out


def check_fp8_grouped_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] | None,
    expert_ends: torch.Tensor,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or device does not fit."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x must be 2-d fp32/fp16/bf16, got {tuple(x.shape)} {x.dtype}")
    if weight.dim() != 3 or weight.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise ValueError(f"weight must be (E, N, K) float8_e4m3fn, got {weight.dtype}")
    if not weight.is_contiguous() or not scale.is_contiguous() or x.stride(1) != 1:
        raise ValueError("weight, scale and x's rows must be contiguous")
    num_experts, n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns, the weights {k}")
    b0, b1 = block_size or (1, None)
    expected = (num_experts, -(-n // b0), 1 if b1 is None else -(-k // b1))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise ValueError(
            f"scale must be fp32 {expected} for {tuple(weight.shape)} in blocks "
            f"{block_size}, got {scale.dtype} {tuple(scale.shape)}"
        )
    if expert_ends.shape != (num_experts,) or expert_ends.dtype != torch.int32:
        raise ValueError(
            f"expert_ends must be ({num_experts},) int32, got "
            f"{tuple(expert_ends.shape)} {expert_ends.dtype}"
        )
    if any(t.device != x.device for t in (weight, scale, expert_ends)):
        raise ValueError("x, weight, scale and expert_ends must share a device")


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] | None,
    expert_ends: torch.Tensor,
    block_m: int | None = None,
    block_n: int = BLOCK_N,
    block_k: int | None = None,
) -> torch.Tensor:
    """``(rows, N)`` in ``x``'s dtype: row ``r`` of ``x (rows, K)`` times ``W_e^T``, ``e`` the
    expert whose range ``[expert_ends[e - 1], expert_ends[e])`` holds ``r`` (``expert_ends``
    int32, non-decreasing, on the device; rows past its last entry get zeros). ``W_e`` is
    ``weight[e]`` times ``scale[e]`` per block, or per row with ``block_size=None``. The
    launch depends on the shapes only."""
    check_fp8_grouped_args(x, weight, scale, block_size, expert_ends)
    block_m = block_m or default_block_m(x.shape[0])
    block_k = block_k or (64 if block_size is None else default_block_k(block_size))
    num_experts, n, k = weight.shape
    rows = x.shape[0]
    columns = None if block_size is None else block_size[1]
    tiles = (block_m, block_n, block_k)
    out, grid = start_gemm("fp8_grouped_linear", KERNEL, x, n, tiles, BLOCK_K_SIZES, columns)
    if grid is None:
        return out
    # Per row: one "block" as wide as K rounded up to the K step, so every step reads it.
    b0, b1 = block_size or (1, triton.cdiv(k, block_k) * block_k)
    _fp8_grouped_gemm_kernel[grid](
        x, weight.view(torch.uint8), scale, expert_ends, out,
        rows, n, k, num_experts, x.stride(0), out.stride(0),
        B0=b0, B1=b1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=triton.next_power_of_2(num_experts),
        WIDEN=x.dtype == torch.float32 or not x.is_cuda,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def e4m3fn_values(b):
        """fp32 values of float8_e4m3fn bytes (int32 0-255), exactly (weights are never
        NaN): the bits of an fp32 with the exponent rebiased, or m x 2^-9 when subnormal."""
        sign = (b >> 7) << 31
        e = (b >> 3) & 15
        m = b & 7
        normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # m x 2^-9
        return tl.where(e == 0, tl.where(sign != 0, -sub, sub), normal)

    @triton.jit(do_not_specialize=["num_rows"])  # one compile for every batch's rows
    def _fp8_block_gemm_kernel(
        x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
        num_rows, N, K, stride_xm, stride_om,
        B0: tl.constexpr, B1: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr, WIDEN: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < num_rows
        col_mask = cols < N
        x_rows = rows.to(tl.int64) * stride_xm  # int64: rows * K may pass 2^31 in a prefill
        w_rows = cols.to(tl.int64) * K
        scale_rows = (cols // B0) * ((K + B1 - 1) // B1)  # each column's row of block scales
        acc = _fp8_tile_product(
            x_ptr, x_rows, row_mask, w_ptr, w_rows, col_mask, scale_ptr, scale_rows, K,
            B1, BLOCK_M, BLOCK_N, BLOCK_K, WIDEN,
        )  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + (rows.to(tl.int64) * stride_om)[:, None] + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])

    @triton.jit
    def _fp8_tile_product(
        x_ptr, x_rows, x_mask_rows, w_ptr, w_rows, col_mask, scale_ptr, scale_rows, K,
        B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        WIDEN: tl.constexpr,
    ):  # fmt: skip
        """fp32 ``(BLOCK_M, BLOCK_N)``: the rows ``x_rows`` (offsets; ``x_mask_rows``) of
        ``x`` times the FP8 weight rows ``w_rows`` (offsets of their first byte), each K
        step's sums times its column's block scale (``scale_rows``: offsets of each
        column's row of scales)."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_mask = k < K
            x_mask = x_mask_rows[:, None] & k_mask[None, :]
            xt = tl.load(x_ptr + x_rows[:, None] + k[None, :], mask=x_mask, other=0.0)
            w_mask = col_mask[:, None] & k_mask[None, :]
            b = tl.load(w_ptr + w_rows[:, None] + k[None, :], mask=w_mask, other=0)
            w = e4m3fn_values(b.to(tl.int32))  # (BLOCK_N, BLOCK_K)
            if WIDEN:
                part = tl.dot(xt.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:  # exact: every e4m3fn value is a bf16 / fp16 value
                part = tl.dot(xt, tl.trans(w.to(xt.dtype)))
            s = tl.load(scale_ptr + scale_rows + k0 // B1, mask=col_mask, other=0.0)
            acc += part * s[None, :]
        return acc

    @triton.jit(do_not_specialize=["num_rows"])  # one compile for every batch's rows
    def _fp8_grouped_gemm_kernel(
        x_ptr, w_ptr, scale_ptr, ends_ptr, out_ptr,
        num_rows, N, K, num_experts, stride_xm, stride_om,
        B0: tl.constexpr, B1: tl.constexpr,
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
        x_rows = rows.to(tl.int64) * stride_xm  # int64: rows * K may pass 2^31 in a prefill
        scale_cols = (K + B1 - 1) // B1
        scale_n = (N + B0 - 1) // B0
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for e in range(first_expert, last_expert + 1):
            start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
            end = tl.load(ends_ptr + e)
            if end > start:
                in_expert = (rows >= start) & (rows < tl.minimum(end, num_rows))
                # int64: the stacked experts pass 2^31 bytes in large models (E * N * K)
                w_rows = (cols.to(tl.int64) + e * N) * K
                scale_rows = ((cols // B0).to(tl.int64) + e * scale_n) * scale_cols
                part = _fp8_tile_product(
                    x_ptr, x_rows, in_expert, w_ptr, w_rows, col_mask, scale_ptr, scale_rows,
                    K, B1, BLOCK_M, BLOCK_N, BLOCK_K, WIDEN,
                )  # fmt: skip
                # Rows of other experts multiplied zeros: keep only this expert's rows.
                acc = tl.where(in_expert[:, None], part, acc)
        out = out_ptr + (rows.to(tl.int64) * stride_om)[:, None] + cols[None, :]
        out_mask = (rows < num_rows)[:, None] & col_mask[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
