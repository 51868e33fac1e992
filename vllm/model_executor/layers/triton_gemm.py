"""What the weight formats' Triton GEMMs share (``triton_fp8_gemm``, ``triton_w4a16``,
``triton_mxfp4_moe``): where they can run, the rows a program takes, the checks and the
output every launch starts from, and the experts a grouped kernel's row tile spans."""

from __future__ import annotations

import importlib.util
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the kernels' modules say why they cannot run
    triton = None
    tile_experts = None


def gemm_unavailable_reason(device: torch.device, kernel: str) -> str | None:
    """Why the Triton ``kernel`` cannot run on ``device`` (None: it can): CUDA with triton;
    CPU tensors only in Triton's interpreter (the tests)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is available"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"the Triton {kernel} runs on CUDA, not {device.type}"


def default_block_m(num_rows: int, decode_rows: int = 256) -> int:
    """Rows a program takes: 16 (``tl.dot``'s least) for batches of up to ``decode_rows``
    rows (decode-sized), 64 above."""
    return 16 if num_rows <= decode_rows else 64


TILE_SIZES = (16, 32, 64, 128)  # what a GEMM's block_m / block_n may be


def start_gemm(
    name: str,
    kernel: str,
    x: torch.Tensor,
    n: int,
    tiles: tuple[int, int, int],
    k_sizes: tuple[int, ...],
    k_divides: int | None = None,
) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """What a GEMM wrapper (``name``, running the Triton ``kernel``) does before its launch:
    refuse tiles ``(block_m, block_n, block_k)`` outside ``TILE_SIZES`` / ``k_sizes`` (or a
    ``block_k`` not dividing ``k_divides`` columns, where the weight's blocks need it) with
    a ValueError naming them, and a device the kernel cannot run on with a RuntimeError;
    then the ``(rows, n)`` output in ``x``'s dtype and the launch grid, one program per
    ``block_m x block_n`` tile (None when the output is empty: nothing to launch)."""
    block_m, block_n, block_k = tiles
    if (
        block_m not in TILE_SIZES
        or block_n not in TILE_SIZES
        or block_k not in k_sizes
        or (k_divides is not None and k_divides % block_k)
    ):
        columns = "" if k_divides is None else f", dividing the blocks' {k_divides} columns"
        raise ValueError(
            f"{name}: tiles block_m={block_m}, block_n={block_n} must be in {TILE_SIZES} "
            f"and block_k={block_k} in {k_sizes}{columns}"
        )
    reason = gemm_unavailable_reason(x.device, kernel)
    if reason is not None:
        raise RuntimeError(f"{name}: {reason}")
    rows = x.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out, None
    return out, (-(-rows // block_m), -(-n // block_n))


if triton is not None:

    @triton.jit
    def tile_experts(ends_ptr, first_row, num_rows, num_experts,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
        """(first, last) expert a grouped kernel's tile of ``BLOCK_M`` expert-sorted rows
        from ``first_row`` belongs to: those ending past its first row, up to the one
        holding its last row, from the experts' ends (``ends_ptr``, on the device: no host
        sync; ``BLOCK_E`` >= ``num_experts``)."""
        experts = tl.arange(0, BLOCK_E)
        ends = tl.load(ends_ptr + experts, mask=experts < num_experts, other=2147483647)
        last_row = tl.minimum(first_row + BLOCK_M, num_rows) - 1
        first_expert = tl.sum((ends <= first_row).to(tl.int32))
        last_expert = tl.minimum(tl.sum((ends <= last_row).to(tl.int32)), num_experts - 1)
        return first_expert, last_expert
