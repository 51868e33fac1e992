"""Paged attention with torch's own FlashAttention kernels
(``torch.nn.attention.varlen.varlen_attn``: CUDA, fp16/bf16, nothing to build or install).

One ``varlen_attn`` call per layer covers the whole flat batch: decodes, whole prompts and
chunks over a cached prefix alike (``varlen_metadata`` holds the per-step layout, built
once and shared by every layer). The causal mask is FlashAttention-2's, aligned to the
bottom-right corner: query row ``j`` of a chunk of ``q_len`` over ``seq_len`` keys sees
keys ``[0, seq_len - q_len + j]``, which is what a chunk over a cached prefix needs. GQA
is native (``enable_gqa``): query head ``h`` reads KV head ``h // (heads // kv_heads)``.

What the installed torch offers is read from ``varlen_attn``'s signature, never from its
version (torch 2.11 has packed varlen with GQA; 2.13 adds ``block_table``/``seqused_k``):

- **paged** when ``varlen_attn`` takes ``block_table`` and ``seqused_k`` and the block
  size is a multiple of 256: the cache's ``(num_blocks, block_size, kv_heads, head_dim)``
  halves are the page pool. torch's FlashAttention-2 (``mha_varlen_fwd``) refuses other
  page sizes ("Paged KV cache block size must be divisible by 256").
- **gathered** otherwise (e.g. the default block size 16): the step's context slots are
  gathered into packed ``(total_k, kv_heads, head_dim)`` K/V per layer, passed with
  ``cu_seq_k``. One copy of the step's context K/V per layer, no per-shape planning.

Older signatures are met too: causal through ``is_causal=`` where there is no
``window_size=``, the scale folded into the query where there is no ``scale=``, K/V heads
repeated where there is no ``enable_gqa=``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm._custom_ops import reshape_and_cache_torch
from vllm.v1.attention.backends.abstract import AttentionBackend, SeqLayout
from vllm.v1.attention.backends.varlen_metadata import VarlenMetadata, build_varlen_metadata

# torch's FlashAttention-2 reads a paged cache only with pages of a multiple of this.
PAGED_BLOCK_MULTIPLE = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)  # FlashAttention-2: Ampere or newer


def load_varlen_attn() -> Callable[..., torch.Tensor] | None:
    """torch's ``varlen_attn``, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@dataclass(frozen=True)
class VarlenFeatures:
    """What the installed ``varlen_attn`` accepts, read from its signature."""

    paged: bool  # block_table= and seqused_k=
    gqa: bool  # enable_gqa=
    scale: bool  # scale=
    causal: str | None  # the keyword that asks for a causal mask: window_size / is_causal

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> VarlenFeatures:
        params = inspect.signature(fn).parameters
        causal = next((k for k in ("window_size", "is_causal") if k in params), None)
        return cls(
            paged="block_table" in params and "seqused_k" in params,
            gqa="enable_gqa" in params,
            scale="scale" in params,
            causal=causal,
        )


def flash_unavailable_reason(device: torch.device) -> str | None:
    """Why torch's FlashAttention cannot run on ``device`` (None: it can): no
    ``varlen_attn``, a torch built without flash attention, or a GPU older than Ampere."""
    fn = load_varlen_attn()
    if fn is None:
        return "this torch has no torch.nn.attention.varlen.varlen_attn"
    if VarlenFeatures.of(fn).causal is None:
        return "torch's varlen_attn takes neither window_size= nor is_causal="
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch was built without FlashAttention"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"FlashAttention needs compute capability >= 8.0, the GPU has {capability}"
    return None


class TorchFlashAttentionBackend(AttentionBackend):
    """``varlen_attn`` over the paged cache as a backend: CUDA, fp16/bf16, head size a
    multiple of 8 up to 256, any block size (paged where torch and the block size allow,
    gathered otherwise; see the module docstring)."""

    name = "TORCH_FLASH_ATTN"
    priority = 20  # ahead of FLASH_ATTN (the flash-attn package) and TORCH_SDPA
    decodes_first = False
    device_types = ("cuda",)
    supported_dtypes = SUPPORTED_DTYPES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        attn = load_varlen_attn()
        if attn is None:
            raise RuntimeError(f"{self.name}: this torch has no varlen_attn")
        self._attn = attn
        self.features = VarlenFeatures.of(attn)
        self.paged = self.features.paged and self.block_size % PAGED_BLOCK_MULTIPLE == 0
        # Keyword arguments every call shares (the mask and the scale are added per call).
        self._kwargs: dict[str, Any] = {"enable_gqa": True} if self.features.gqa else {}

    @classmethod
    def supports_device(cls, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size <= MAX_HEAD_DIM and head_size % 8 == 0

    @classmethod
    def validate_configuration(
        cls, device: torch.device, dtype: torch.dtype, block_size: int, head_size: int
    ) -> list[str]:
        reasons = super().validate_configuration(device, dtype, block_size, head_size)
        if not reasons:  # the import and device query last: they are not free
            reason = flash_unavailable_reason(device)
            if reason:
                reasons.append(reason)
        return reasons

    @property
    def detail(self) -> str:
        if self.paged:
            return f"paged KV through block_table (block size {self.block_size})"
        if not self.features.paged:
            why = "this torch's varlen_attn has no block_table"
        else:
            why = f"block size {self.block_size} is not a multiple of {PAGED_BLOCK_MULTIPLE}"
        return f"{why}: contexts are gathered per step"

    def build_metadata(self, seqs: list[SeqLayout]) -> VarlenMetadata:
        return build_varlen_metadata(seqs, self.block_size, self.device, self.paged)

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_size)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_size)
        meta: VarlenMetadata,
        scale: float,
    ) -> torch.Tensor:
        # The metadata's slots come from block ids: none is padding.
        reshape_and_cache_torch(k, v, kv_cache, meta.slot_mapping, padded=False)
        kwargs = dict(self._kwargs)
        if self.features.causal == "is_causal":
            kwargs["is_causal"] = True
        elif meta.max_q > 1:
            kwargs["window_size"] = (-1, 0)  # causal; a tuple: varlen_attn compares to one
        else:
            # Decodes only: each query is its context's last position, so causal is full
            # attention, and (-1, -1) lets the kernel fold GQA's query groups into rows.
            kwargs["window_size"] = (-1, -1)
        if self.features.scale:
            kwargs["scale"] = scale
        else:  # the kernel's own scale is head_size ** -0.5
            q = q * (scale * self.head_size**0.5)
        if meta.paged:
            keys, values = kv_cache.unbind(0)  # (num_blocks, block_size, kv_heads, dim) each
            kwargs.update(seqused_k=meta.seqused_k, block_table=meta.block_table)
        else:
            flat_k, flat_v = kv_cache.view(2, -1, *kv_cache.shape[3:]).unbind(0)
            keys = flat_k.index_select(0, meta.gather_slots)  # (total_k, kv_heads, dim)
            values = flat_v.index_select(0, meta.gather_slots)
            if not self.features.gqa and self.num_heads != self.num_kv_heads:
                group = self.num_heads // self.num_kv_heads
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
        return self._attn(
            q, keys, values, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, **kwargs
        )
