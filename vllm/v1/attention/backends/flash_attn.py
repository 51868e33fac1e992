"""Paged attention with FlashAttention-2's varlen kernel (CUDA, fp16/bf16).

One ``flash_attn.flash_attn_varlen_func`` call per layer covers the whole flat batch:
decodes, prefill chunks and chunks over a cached prefix alike. Sequence ``i`` owns query
rows ``cu_seq_q[i]:cu_seq_q[i+1]`` and ``seqused_k[i]`` keys (its cached context
plus this step's tokens, already written to the cache). ``causal=True`` is what we want
for all of them because flash-attn aligns the causal mask to the bottom-right corner:
query row ``j`` of a chunk sees keys ``[0, seq_len - q_len + j]``.

Two ways to hand the keys over, chosen once from the block size:

- **paged** (``block_size % 256 == 0``): ``block_table=`` over the cache viewed as
  ``(num_blocks, block_size, kv_heads, head_dim)``. Upstream flash-attn 2 refuses other
  page sizes ("Paged KV cache block size must be divisible by 256"); vLLM gets 16 from
  its own fork, which we do not depend on.
- **gathered** (any other block size, e.g. the default 16): the contexts' slots are
  gathered into one packed ``(total_k, kv_heads, head_dim)`` tensor and passed with
  ``cu_seqlens_k``. That costs one copy of the step's context K/V per layer, which is
  also what the torch backend pays, and keeps the kernel on the documented API.

The per-step layout (``varlen_metadata``) is shared with ``TORCH_FLASH_ATTN``, torch's own
FlashAttention, which the selector prefers: ``FlashAttentionBackend`` (``FLASH_ATTN``) is
taken on CUDA with fp16/bf16 when torch's cannot run and the package imports. The
``flash_attn`` import is lazy: this module imports on a CPU-only machine.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from vllm._custom_ops import reshape_and_cache_torch
from vllm.v1.attention.backends.abstract import AttentionBackend, SeqLayout
from vllm.v1.attention.backends.varlen_metadata import (
    FlashAttentionLimits,
    VarlenMetadata,
    build_varlen_metadata,
)

# Upstream flash-attn 2 only accepts paged caches whose page size is a multiple of this.
FLASH_ATTN_PAGE_MULTIPLE = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def supports_block_table(block_size: int) -> bool:
    """Whether flash-attn 2 can read our paged cache directly through ``block_table``."""
    return block_size % FLASH_ATTN_PAGE_MULTIPLE == 0


def build_flash_metadata(
    seqs: list[SeqLayout], block_size: int, device: torch.device | str
) -> VarlenMetadata:
    """``seqs``: per request in batch order, (num_computed, num_new, block_ids); any
    order of decodes and prefills. Paged when the block size allows it."""
    return build_varlen_metadata(seqs, block_size, device, supports_block_table(block_size))


def _varlen_func() -> Any:
    from flash_attn import flash_attn_varlen_func  # lazy: CUDA-only optional dependency

    return flash_attn_varlen_func


def flash_paged_attention(
    q: torch.Tensor,  # (num_tokens, heads, head_dim)
    k: torch.Tensor,  # (num_tokens, kv_heads, head_dim)
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, kv_heads, head_dim)
    meta: VarlenMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns (num_tokens, heads, dim).

    Same contract as ``torch_sdpa.paged_attention``; GQA is native to flash-attn (query
    head ``h`` reads KV head ``h // (heads // kv_heads)``), so K/V are never repeated."""
    reshape_and_cache_torch(k, v, kv_cache, meta.slot_mapping, padded=False)  # no padding
    if meta.paged:
        keys, values = kv_cache[0], kv_cache[1]  # (num_blocks, block_size, kv_heads, dim)
        block_table = meta.block_table
    else:
        kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        keys = kv_cache[0].view(-1, kv_heads, head_dim).index_select(0, meta.gather_slots)
        values = kv_cache[1].view(-1, kv_heads, head_dim).index_select(0, meta.gather_slots)
        block_table = None
    return _varlen_func()(
        q,
        keys,
        values,
        cu_seqlens_q=meta.cu_seq_q,
        cu_seqlens_k=meta.cu_seq_k,
        max_seqlen_q=meta.max_q,
        max_seqlen_k=meta.max_k,
        softmax_scale=scale,
        causal=True,
        block_table=block_table,
    )


def flash_attn_importable() -> bool:
    try:
        importlib.import_module("flash_attn")
    except Exception:  # ImportError, or a wheel built for another torch/CUDA (OSError...)
        return False
    return True


class FlashAttentionBackend(FlashAttentionLimits, AttentionBackend):
    """The functions above as a backend: CUDA, fp16/bf16, head size a multiple of 8 up to
    256, the ``flash_attn`` package importable. Any block size: paged through
    ``block_table`` when it is a multiple of 256, the contexts gathered per step else."""

    name = "FLASH_ATTN"
    priority = 10
    decodes_first = False
    supported_dtypes = SUPPORTED_DTYPES

    @classmethod
    def validate_configuration(
        cls, device: torch.device, dtype: torch.dtype, block_size: int, head_size: int
    ) -> list[str]:
        reasons = super().validate_configuration(device, dtype, block_size, head_size)
        if not reasons and not flash_attn_importable():  # the import last: it is not cheap
            reasons.append("the flash-attn package is not importable (pip install '.[cuda]')")
        return reasons

    @property
    def detail(self) -> str:
        if supports_block_table(self.block_size):
            return f"paged KV through block_table (block size {self.block_size})"
        return (
            f"block size {self.block_size} is not a multiple of {FLASH_ATTN_PAGE_MULTIPLE}"
            " (upstream flash-attn's paged minimum): contexts are gathered per step"
        )

    def build_metadata(self, seqs: list[SeqLayout]) -> VarlenMetadata:
        return build_flash_metadata(seqs, self.block_size, self.device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: VarlenMetadata,
        scale: float,
    ) -> torch.Tensor:
        return flash_paged_attention(q, k, v, kv_cache, meta, scale)
