"""Picks the attention backend for a model runner: flash-attn on CUDA when it can, torch
otherwise.

``VLLM_ATTENTION_BACKEND`` (vLLM's variable) forces a choice: ``TORCH_SDPA`` always
works; ``FLASH_ATTN`` raises if its requirements are not met instead of silently falling
back, so a forced benchmark never measures the wrong kernel.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm import envs
from vllm.v1.attention.backends import flash_attn, torch_sdpa

logger = logging.getLogger(__name__)

ENV_VAR = "VLLM_ATTENTION_BACKEND"
TORCH_SDPA = "TORCH_SDPA"
FLASH_ATTN = "FLASH_ATTN"


@dataclass(frozen=True)
class AttentionBackend:
    """A backend is a metadata builder (called once per step) and a per-layer forward.

    ``build_metadata(seqs, block_size, device)`` takes, per request in batch order,
    ``(num_computed, num_new, block_ids)``; ``forward(q, k, v, kv_cache, meta, scale)``
    writes the new K/V at the slot mapping and returns ``(num_tokens, heads, head_dim)``.
    ``decodes_first``: the builder needs single-token decodes before prefill chunks.
    """

    name: str
    build_metadata: Callable[[list[tuple[int, int, list[int]]], int, torch.device], Any]
    forward: Callable[..., torch.Tensor]
    decodes_first: bool
    detail: str = ""


TORCH_BACKEND = AttentionBackend(
    TORCH_SDPA, torch_sdpa.build_metadata, torch_sdpa.paged_attention, decodes_first=True
)


def _flash_attn_importable() -> bool:
    try:
        importlib.import_module("flash_attn")
    except Exception:  # ImportError, or a wheel built for another torch/CUDA (OSError...)
        return False
    return True


def _flash_attn_unsupported(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Why flash-attn cannot run here ('' when it can). Cheap checks before the import."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"device is {device.type}, flash-attn needs CUDA"
    if dtype not in flash_attn.SUPPORTED_DTYPES:
        return f"dtype {dtype} (flash-attn supports float16 and bfloat16)"
    if head_dim > flash_attn.MAX_HEAD_DIM or head_dim % 8:
        return f"head_dim {head_dim} (flash-attn needs a multiple of 8, at most 256)"
    if not _flash_attn_importable():
        return "the flash-attn package is not importable (pip install '.[cuda]')"
    return ""


def select_attention_backend(
    device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int
) -> AttentionBackend:
    """The backend for this device/dtype/block size; see the module docstring."""
    forced = envs.VLLM_ATTENTION_BACKEND
    if forced not in (None, TORCH_SDPA, FLASH_ATTN):
        raise ValueError(f"{ENV_VAR}={forced!r}: expected {TORCH_SDPA} or {FLASH_ATTN}")
    if forced == TORCH_SDPA:
        return TORCH_BACKEND
    why_not = _flash_attn_unsupported(device, dtype, head_dim)
    if why_not:
        if forced == FLASH_ATTN:
            raise ValueError(f"{ENV_VAR}={FLASH_ATTN} but {why_not}")
        if device.type == "cuda":
            logger.warning("Not using flash-attn: %s; using %s", why_not, TORCH_SDPA)
        return TORCH_BACKEND
    if flash_attn.supports_block_table(block_size):
        detail = f"paged KV through block_table (block size {block_size})"
    else:
        detail = (
            f"block size {block_size} is not a multiple of {flash_attn.FLASH_ATTN_PAGE_MULTIPLE}"
            " (upstream flash-attn's paged minimum): contexts are gathered per step"
        )
    return AttentionBackend(
        FLASH_ATTN,
        flash_attn.build_flash_metadata,
        flash_attn.flash_paged_attention,
        decodes_first=False,
        detail=detail,
    )
