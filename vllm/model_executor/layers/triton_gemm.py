"""What the weight formats' Triton GEMMs share (``triton_fp8_gemm``, ``triton_w4a16``,
``triton_mxfp4_moe``): where they can run, the rows a program takes, and the experts a
grouped kernel's row tile spans."""

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
