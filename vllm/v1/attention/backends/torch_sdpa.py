"""Paged attention in pure torch (CPU, and any device as a fallback).

The batch is flat: decode requests (one query token each) come first and are attended
together as a padded batch; each prefill chunk is attended on its own. Gather indices and
masks are built once per step (``build_metadata``) and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vllm._custom_ops import reshape_and_cache


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    num_tokens: int
    # Slots of the whole context (cached prefix + this chunk), or None when the chunk is
    # the whole context (no prefix): then the chunk's own K/V are used directly.
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # (num_tokens, context_len) bool, causal with offset


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: where each token's K/V goes
    num_decodes: int = 0  # tokens [0, num_decodes) are single-token decodes
    decode_slots: torch.Tensor | None = None  # (num_decodes, max_len) int64, padded with 0
    decode_mask: torch.Tensor | None = None  # (num_decodes, 1, 1, max_len) bool
    prefills: list[PrefillChunk] = field(default_factory=list)


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """``seqs``: per request in batch order, (num_computed, num_new, block_ids); decodes
    (num_new == 1 with a context) must come first."""
    slot_mapping: list[int] = []
    decode_rows: list[list[int]] = []
    prefills: list[PrefillChunk] = []
    offset = 0
    for computed, new, block_ids in seqs:
        slot_mapping += _slots(block_ids, computed, computed + new, block_size)
        if new == 1 and computed > 0 and not prefills:
            decode_rows.append(_slots(block_ids, 0, computed + 1, block_size))
        else:
            chunk = PrefillChunk(offset, new)
            if computed > 0:
                ctx = computed + new
                chunk.context_slots = torch.tensor(
                    _slots(block_ids, 0, ctx, block_size), dtype=torch.long, device=device
                )
                chunk.mask = torch.ones(new, ctx, dtype=torch.bool, device=device).tril(computed)
            prefills.append(chunk)
        offset += new
    meta = AttentionMetadata(
        torch.tensor(slot_mapping, dtype=torch.long, device=device),
        len(decode_rows),
        prefills=prefills,
    )
    if decode_rows:
        width = max(len(r) for r in decode_rows)
        meta.decode_slots = torch.tensor(
            [r + [0] * (width - len(r)) for r in decode_rows], dtype=torch.long, device=device
        )
        lens = torch.tensor([len(r) for r in decode_rows], device=device)
        meta.decode_mask = (torch.arange(width, device=device)[None, :] < lens[:, None]).view(
            len(decode_rows), 1, 1, width
        )
    return meta


def paged_attention(
    q: torch.Tensor,  # (num_tokens, heads, head_dim)
    k: torch.Tensor,  # (num_tokens, kv_heads, head_dim)
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, kv_heads, head_dim)
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns (num_tokens, heads, dim)."""
    reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
    kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    flat_k = kv_cache[0].view(-1, kv_heads, head_dim)
    flat_v = kv_cache[1].view(-1, kv_heads, head_dim)
    out = torch.empty_like(q)
    n = meta.num_decodes
    if n:
        keys = flat_k[meta.decode_slots].transpose(1, 2)  # (n, kv_heads, max_len, dim)
        values = flat_v[meta.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q[:n].unsqueeze(2),
            keys,
            values,
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=True,
        )  # (n, heads, 1, dim)
        out[:n] = o.squeeze(2)
    for chunk in meta.prefills:
        s, e = chunk.start, chunk.start + chunk.num_tokens
        query = q[s:e].transpose(0, 1).unsqueeze(0)  # (1, heads, len, dim)
        if chunk.context_slots is None:
            keys, values = k[s:e], v[s:e]
        else:
            keys, values = flat_k[chunk.context_slots], flat_v[chunk.context_slots]
        o = F.scaled_dot_product_attention(
            query,
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[s:e] = o[0].transpose(0, 1)
    return out
