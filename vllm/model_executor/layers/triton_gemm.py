"""What the weight formats' Triton GEMMs share (``triton_fp8_gemm``, ``triton_w4a16``,
``triton_mxfp4_moe``): where they can run, and the rows a program takes."""

from __future__ import annotations

import importlib.util
import os

import torch


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
