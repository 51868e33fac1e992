"""Paged attention for CPU (and any device as a fallback): torch SDPA, plus a native decode
kernel.

The batch is flat: decode requests (one query token each) come first and are attended
together; each prefill chunk is attended on its own with SDPA. Decodes read the paged cache
in place through their block tables (``paged_decode_attention``, csrc/cpu) when the native
kernels are built; otherwise their contexts are gathered into a padded batch for one SDPA
call. Metadata is built once per step (``build_metadata``) and reused by every layer; the
decodes' per-position gather indices are derived (in torch, once) only when the fallback
needs them, so a decode step's Python work grows with its blocks, not its tokens.

An FP8 KV cache (``--kv-cache-dtype fp8``) is read by the gathers, widened to the
query's dtype; its decodes skip the native kernel (which reads the model's dtype).

A latent cache (``latent_kv``, MLA: keys only, a value is its key's first ``value_size``
dims) is read through a view of the K half as the values, so every path below serves it
unchanged; the native kernels, which read values as wide as the keys, take the whole
latent rows as the values and the output keeps their first ``value_size`` dims (the
decode kernel reads a one-plane cache's K plane as its V plane). The output is
``value_size`` wide.

A layer with a sliding window, soft-capped scores (Gemma 2) or attention sinks (gpt-oss)
takes a masked path instead (``_masked_paged_attention``): windowed gathers and explicit
masks, SDPA, or an eager fp32 softmax where SDPA cannot express the scores. A prefill chunk
whose rows include spans that attend both ways (``bidirectional_spans``: Gemma 3's images,
``AttentionMetadata.attend_both_ways``) is attended under an explicit mask too.

Prefill chunks on CPU in fp32 take the native flash-style kernel (``prefill_attention``,
csrc/cpu/prefill_attention.cpp: AVX-512, head_dim a multiple of 64) when it is built, in
fp32 (equal to SDPA up to float rounding) or, when the caller asks (``prefill_bf16``), with
its products in bf16; SDPA otherwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F

from vllm import _custom_ops as ops
from vllm._custom_ops import reshape_and_cache
from vllm.utils.device import to_device
from vllm.v1.attention.backends.abstract import AttentionBackend, SeqLayout
from vllm.v1.attention.kv_cache_dtype import as_stored, is_fp8


@dataclass
class PrefillChunk:
    start: int  # first token of the chunk in the flat batch
    num_tokens: int
    # Slots of the whole context (cached prefix + this chunk), or None when the chunk is
    # the whole context (no prefix): then the chunk's own K/V are used directly.
    context_slots: torch.Tensor | None = None
    # Per window (None: the whole context) of a masked layer: (first key, mask), built by
    # the first layer with that window and reused by the others (``window_mask``).
    windowed: dict[int | None, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # Rows [a, b) of the chunk (relative to ``start``) that attend to each other both ways
    # (the ``bidirectional_spans`` feature: one image's tokens in Gemma 3); set by
    # ``AttentionMetadata.attend_both_ways``. Such a chunk takes the masked path.
    spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_computed(self) -> int:
        """Tokens of the context before this chunk (its cached prefix)."""
        if self.context_slots is None:
            return 0
        return self.context_slots.shape[0] - self.num_tokens

    def window_mask(self, window: int | None, device: torch.device) -> tuple[int, torch.Tensor]:
        """(first, mask): the first context position any query of the chunk reaches, and
        the (num_tokens, context_len - first) bool mask of the keys each query sees from
        there: causal, or within one of ``spans`` (each span's rows see each other), and,
        with ``window``, only keys ``j > i - window`` of query ``i`` (transformers' Gemma 3
        masks: the window ANDed over causal OR span)."""
        if window not in self.windowed:
            computed = self.num_computed
            first = 0 if window is None else max(0, computed - window + 1)
            q_pos = torch.arange(computed, computed + self.num_tokens, device=device)
            k_pos = torch.arange(first, computed + self.num_tokens, device=device)
            mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
            for a, b in self.spans:
                mask[a:b, computed + a - first : computed + b - first] = True
            if window is not None:
                mask &= k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - window
            self.windowed[window] = (first, mask)
        return self.windowed[window]

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """(num_tokens, context_len) bool, causal with offset; None without a prefix. Built
        on first use: only the SDPA fallback reads it (the native kernel takes the offset)."""
        if self.context_slots is None:
            return None
        ctx = self.context_slots.shape[0]
        ones = torch.ones(self.num_tokens, ctx, dtype=torch.bool, device=self.context_slots.device)
        return ones.tril(ctx - self.num_tokens)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64: where each token's K/V goes
    num_decodes: int = 0  # tokens [0, num_decodes) are single-token decodes
    block_size: int = 16
    # (num_decodes, max_blocks) int64, rows padded with the null block 0 (never read).
    decode_block_table: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None  # (num_decodes,) int64: context incl. the new
    decode_max_len: int = 0  # max of decode_seq_lens, kept on the host (no device read-back)
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Per sliding window: the decodes' (slots, mask) over their last `window` positions,
    # built by the first layer with that window and reused by the others.
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def attend_both_ways(self, spans: list[tuple[int, int]]) -> None:
        """Rows ``[a, b)`` of the flat batch, each span inside one prefill chunk, attend to
        each other both ways (``PrefillChunk.spans``); a span of one row changes nothing.
        ``ValueError`` for a span that no chunk holds whole (a decode row, or across
        chunks)."""
        for a, b in spans:
            if b - a < 2:
                continue
            chunk = next(
                (c for c in self.prefills if c.start <= a and b <= c.start + c.num_tokens), None
            )
            if chunk is None:
                raise ValueError(f"rows {a}:{b} attend both ways but no prefill chunk holds them")
            chunk.spans.append((a - chunk.start, b - chunk.start))
            chunk.windowed.clear()

    def causal(self) -> AttentionMetadata:
        """This step's metadata with every row attending causally (a shallow copy whose
        chunks hold no spans; itself when none does): for the layers whose image tokens
        do not see each other both ways (Gemma 4's global layers)."""
        if not any(c.spans for c in self.prefills):
            return self
        out = copy.copy(self)
        out.prefills = [replace(c, spans=[], windowed={}) if c.spans else c for c in self.prefills]
        return out

    def decode_window(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(num_decodes, width) int64 slots of each decode's last ``window`` positions
        (``width = min(window, decode_max_len)``, padded with slot 0) and the
        (num_decodes, 1, 1, width) bool mask of the real ones."""
        if window not in self.windowed:
            lens = self.decode_seq_lens
            width = min(window, self.decode_max_len)
            start = (lens - window).clamp(min=0)
            pos = start.unsqueeze(1) + torch.arange(width, device=lens.device)
            valid = pos < lens.unsqueeze(1)
            pos.masked_fill_(valid.logical_not(), 0)
            slots = self.decode_block_table.gather(1, pos // self.block_size) * self.block_size
            slots += pos % self.block_size
            slots.masked_fill_(valid.logical_not(), 0)
            self.windowed[window] = (slots, valid.view(self.num_decodes, 1, 1, width))
        return self.windowed[window]

    @cached_property
    def decode_slots(self) -> torch.Tensor | None:
        """(num_decodes, max_len) int64: each decode's context slots, padded with 0 (the
        fallback's gather indices; computed on first use)."""
        if not self.num_decodes:
            return None
        pos = torch.arange(self.decode_max_len, device=self.slot_mapping.device)
        table = self.decode_block_table.index_select(1, pos // self.block_size)
        slots = table * self.block_size
        slots += pos % self.block_size
        return slots.masked_fill_(self.decode_mask.view(self.num_decodes, -1).logical_not(), 0)

    @cached_property
    def decode_mask(self) -> torch.Tensor | None:
        """(num_decodes, 1, 1, max_len) bool: position < the decode's context length."""
        if not self.num_decodes:
            return None
        lens = self.decode_seq_lens
        pos = torch.arange(self.decode_max_len, device=lens.device)
        return (pos.unsqueeze(0) < lens.unsqueeze(1)).view(self.num_decodes, 1, 1, -1)


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_metadata(
    seqs: list[SeqLayout], block_size: int, device: torch.device | str
) -> AttentionMetadata:
    """``seqs``: per request in batch order, (num_computed, num_new, block_ids); decodes
    (num_new == 1 with a context) must come first."""
    slot_mapping: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefills: list[PrefillChunk] = []
    offset = 0
    for computed, new, block_ids in seqs:
        slot_mapping += _slots(block_ids, computed, computed + new, block_size)
        if new == 1 and computed > 0 and not prefills:
            decode_tables.append(block_ids[: computed // block_size + 1])
            decode_lens.append(computed + 1)
        else:
            chunk = PrefillChunk(offset, new)
            if computed > 0:
                ctx = computed + new
                chunk.context_slots = to_device(
                    _slots(block_ids, 0, ctx, block_size), torch.long, device
                )
            prefills.append(chunk)
        offset += new
    meta = AttentionMetadata(
        to_device(slot_mapping, torch.long, device),
        len(decode_lens),
        block_size,
        prefills=prefills,
    )
    if decode_lens:
        width = max(len(t) for t in decode_tables)
        meta.decode_block_table = to_device(
            [t + [0] * (width - len(t)) for t in decode_tables], torch.long, device
        )
        meta.decode_seq_lens = to_device(decode_lens, torch.long, device)
        meta.decode_max_len = max(decode_lens)
    return meta


def _decode_attention(
    q: torch.Tensor,  # (n, heads, head_dim)
    flat_k: torch.Tensor,  # (slots, kv_heads, head_dim)
    flat_v: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """The fallback: gather each decode's whole context (padded), one SDPA call."""
    keys = _read(flat_k, meta.decode_slots, q.dtype).transpose(1, 2)  # (n, kv_heads, len, dim)
    values = _read(flat_v, meta.decode_slots, q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
    )  # (n, heads, 1, dim)
    return o.squeeze(2)


def _read(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's rows at ``slots``, in ``dtype`` (an FP8 cache's values widened)."""
    rows = flat[slots]
    return rows if rows.dtype == dtype else rows.to(dtype)


def _rows_ok(t: torch.Tensor) -> bool:
    """(tokens, heads, dim) fp32 on CPU with each row's heads contiguous (rows may be
    strided): the layout the native prefill kernel reads."""
    return (
        t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.stride(2) == 1
        and t.stride(1) == t.shape[2]
    )


def native_prefill_attention(
    out: torch.Tensor,  # (len_q, heads, head_dim), written
    query: torch.Tensor,  # (len_q, heads, head_dim)
    keys: torch.Tensor,  # (len_k, kv_heads, head_dim), len_k >= len_q
    values: torch.Tensor,
    scale: float,
    bf16: bool = False,
) -> bool:
    """Causal attention of the last ``len_q`` positions of a ``len_k`` context (query i sees
    keys j <= i + len_k - len_q) with the native kernel; False (``out`` untouched) when it
    is not built or does not support the shapes / the CPU (then use SDPA). ``bf16``: Q, K,
    P and V rounded to bf16 in the products (max abs error ~1e-2 at unit-scale inputs)."""
    op = ops._op("prefill_attention")  # it returns False itself for an unsupported head_dim
    if op is None or not all(_rows_ok(t) for t in (out, query, keys, values)):
        return False
    return op(out, query, keys, values, scale, keys.shape[0] - query.shape[0], bf16)


def _native_chunk(
    out: torch.Tensor,  # (len_q, heads, value dim), written when True is returned
    q: torch.Tensor,
    keys: torch.Tensor,  # (len_k, kv_heads, head_dim)
    values: torch.Tensor,  # as wide as keys, or a view of their first dims (latent)
    scale: float,
    bf16: bool,
) -> bool:
    """``native_prefill_attention`` of one chunk. The kernel takes values as wide as the
    keys; a latent cache's values (MLA: the first ``value_size`` dims of the same rows)
    go in as the whole rows and the output's first ``value_size`` dims are kept (the other
    64 of 576 are 11% more value work than needed, against SDPA's 3.5-5.6x more time)."""
    if values.shape[2] == keys.shape[2]:
        return native_prefill_attention(out, q, keys, values, scale, bf16)
    prefix_view = values.data_ptr() == keys.data_ptr() and values.stride() == keys.stride()
    if not prefix_view:
        return False
    whole = out.new_empty(out.shape[0], out.shape[1], keys.shape[2])
    if not native_prefill_attention(whole, q, keys, keys, scale, bf16):
        return False
    out.copy_(whole[..., : values.shape[2]])
    return True


# Query rows the eager path (soft caps, sinks) scores at once: bounds its (heads, rows,
# context) fp32 scores to 512 rows' worth however long the prefill chunk is.
_EAGER_QUERY_ROWS = 512


def _eager_attention(
    q: torch.Tensor,  # (batch, heads, len_q, dim)
    k: torch.Tensor,  # (batch, kv_heads, len_k, dim)
    v: torch.Tensor,
    mask: torch.Tensor,  # bool, broadcast to (batch, heads, len_q, len_k): True = attend
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # (heads,): each head's sink logit
) -> torch.Tensor:
    """Attention written out, for what SDPA cannot do: scores soft-capped to
    ``softcap * tanh(s / softcap)`` (Gemma 2) before the mask, and/or a per-head sink
    logit that joins every row's softmax and is dropped after it (gpt-oss: the row's
    weights sum to less than 1), in fp32; output in q's dtype, (batch, heads, len_q, dim)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for s in range(0, q.shape[2], _EAGER_QUERY_ROWS):
        e = min(s + _EAGER_QUERY_ROWS, q.shape[2])
        scores = torch.matmul(q[:, :, s:e].float(), k.transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        rows = mask[..., s:e, :] if mask.shape[-2] > 1 else mask
        scores.masked_fill_(rows.logical_not(), float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        out[:, :, s:e] = torch.matmul(probs, v).to(q.dtype)
    return out


def _attend(q, k, v, mask, scale, softcap, sinks=None) -> torch.Tensor:
    """(batch, heads, len_q, dim) attention of ``q`` over ``k``/``v`` under the bool
    ``mask``: SDPA, or the eager path when the scores are soft-capped or sunk."""
    if softcap is not None or sinks is not None:
        return _eager_attention(q, k, v, mask, scale, softcap, sinks)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _masked_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_attention`` for a layer with a sliding window (each token sees the last
    ``window`` positions, itself included: keys ``j`` with ``i - window < j <= i``, as HF's
    masks and vLLM's ``window_size = (window - 1, 0)``) and/or soft-capped scores and/or
    attention sinks. Decodes gather only their window's slots; prefill chunks are cut to
    the keys their window reaches. Same inputs and output as ``paged_attention``; K/V
    written by the caller."""
    out = q.new_empty(q.shape[:2] + v.shape[2:])
    flat_k, flat_v = cache_views(kv_cache, v.shape[2])
    n = meta.num_decodes
    if n:
        if window is not None:
            slots, mask = meta.decode_window(window)
        else:
            slots, mask = meta.decode_slots, meta.decode_mask
        keys = _read(flat_k, slots, q.dtype).transpose(1, 2)  # (n, kv_heads, width, dim)
        values = _read(flat_v, slots, q.dtype).transpose(1, 2)
        o = _attend(q[:n].unsqueeze(2), keys, values, mask, scale, softcap, sinks)
        out[:n] = o.squeeze(2)
    for chunk in meta.prefills:
        _attend_chunk(out, q, k, v, flat_k, flat_v, chunk, scale, window, softcap, sinks)
    return out


def _attend_chunk(out, q, k, v, flat_k, flat_v, chunk, scale, window, softcap, sinks) -> None:
    """``out``'s rows of ``chunk`` under its explicit mask (``window_mask``): the chunk's
    own K/V (``k``, ``v``) without a prefix, else the cache's keys the window reaches."""
    s, e = chunk.start, chunk.start + chunk.num_tokens
    first, mask = chunk.window_mask(window, q.device)
    if chunk.context_slots is None:  # no prefix: first is 0
        keys, values = k[s:e], v[s:e]
    else:  # only the keys the window reaches are gathered
        slots = chunk.context_slots[first:]
        keys, values = _read(flat_k, slots, q.dtype), _read(flat_v, slots, q.dtype)
    o = _attend(
        q[s:e].transpose(0, 1).unsqueeze(0),  # (1, heads, len, dim)
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        mask,
        scale,
        softcap,
        sinks,
    )
    out[s:e] = o[0].transpose(0, 1)


def both_ways_chunks(
    seqs: list[SeqLayout], spans: list[tuple[int, int]], block_size: int, device
) -> list[PrefillChunk]:
    """For a backend whose kernel attends causally only (the varlen ones): each span
    (rows ``[a, b)`` of the flat batch of ``seqs``, in batch order, inside one sequence)
    as a chunk of its rows alone over its sequence's context up to the span's end, the
    rows seeing each other; ``attend_chunks`` then writes those rows again. A span of
    one row is left out; ``ValueError`` for one across sequences."""
    starts = np.cumsum([0] + [n for _, n, _ in seqs])
    chunks = []
    for a, b in spans:
        if b - a < 2:
            continue
        i = int(np.searchsorted(starts, a, side="right")) - 1
        if not 0 <= i < len(seqs) or b > starts[i + 1]:
            raise ValueError(f"rows {a}:{b} attend both ways but no sequence holds them")
        computed, _, block_ids = seqs[i]
        end = computed + b - int(starts[i])  # the span's end, as a position
        slots = to_device(_slots(block_ids, 0, end, block_size), torch.long, device)
        chunks.append(PrefillChunk(a, b - a, slots, spans=[(0, b - a)]))
    return chunks


def attend_chunks(out, q, kv_cache, chunks, scale, window=None, softcap=None, sinks=None) -> None:
    """``out``'s rows of each of ``chunks`` (``both_ways_chunks``'), attended again from
    the cache (which holds the step's K/V already) under the chunks' masks."""
    flat_k, flat_v = cache_views(kv_cache, out.shape[2])
    for chunk in chunks:
        _attend_chunk(out, q, None, None, flat_k, flat_v, chunk, scale, window, softcap, sinks)


def cache_views(kv_cache: torch.Tensor, value_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache as (slots, kv_heads, head_size) keys and (slots, kv_heads, value_size)
    values: its two halves, or for a latent cache (one half) the keys' first ``value_size``
    dims, a view (no copy)."""
    kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    flat_k = kv_cache[0].view(-1, kv_heads, head_dim)
    if kv_cache.shape[0] == 1:
        return flat_k, flat_k[..., :value_size]
    return flat_k, kv_cache[1].view(-1, kv_heads, head_dim)


def paged_attention(
    q: torch.Tensor,  # (num_tokens, heads, head_dim)
    k: torch.Tensor,  # (num_tokens, kv_heads, head_dim)
    v: torch.Tensor | None,  # None: a latent cache, values read from the keys
    kv_cache: torch.Tensor,  # (2 or 1, num_blocks, block_size, kv_heads, head_dim)
    meta: AttentionMetadata,
    scale: float,
    prefill_bf16: bool = False,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    value_size: int | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend; returns (num_tokens, heads, dim),
    ``value_size`` wide for a latent cache (``v`` None, ``kv_cache`` of one half).
    ``prefill_bf16``: prefill chunks may run the native kernel's bf16 products (for models
    whose prefill already computes in bf16); decodes and the SDPA fallback stay fp32.
    ``sliding_window`` / ``logits_soft_cap`` / ``sinks``: the layer's
    (``_masked_paged_attention``)."""
    reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
    fp8 = is_fp8(kv_cache.dtype)
    if fp8:  # a chunk's own K/V as the cache holds them, as later steps will read them
        k = as_stored(k, kv_cache.dtype)
        v = None if v is None else as_stored(v, kv_cache.dtype)
    latent = v is None
    if latent:
        if value_size is None:
            raise ValueError("a latent cache (v None) needs value_size")
        v = k[..., :value_size]  # a view: the values are the keys' first dims
    if sliding_window is not None or logits_soft_cap is not None or sinks is not None:
        return _masked_paged_attention(
            q, k, v, kv_cache, meta, scale, sliding_window, logits_soft_cap, sinks
        )
    out = q.new_empty(q.shape[:2] + v.shape[2:])
    n = meta.num_decodes
    native = (
        n > 0 and q.device.type == "cpu" and q.dtype == torch.float32 and not fp8
    ) and ops.has_paged_decode_attention()
    if native:
        whole = n == q.shape[0]  # a pure decode step: no slicing
        # A latent cache: the kernel's values are the whole rows; the first dims are kept.
        dst = q.new_empty(n, *q.shape[1:]) if latent else out if whole else out[:n]
        ops.paged_decode_attention(
            dst,
            q if whole else q[:n],
            kv_cache,
            meta.decode_block_table,
            meta.decode_seq_lens,
            scale,
        )
        if latent:
            out[:n] = dst[..., : v.shape[2]]
    if native and not meta.prefills:
        return out
    flat_k, flat_v = cache_views(kv_cache, v.shape[2])
    if n and not native:
        out[:n] = _decode_attention(q[:n], flat_k, flat_v, meta, scale)
    prefill_attention(out, q, k, v, flat_k, flat_v, meta.prefills, scale, prefill_bf16)
    return out


def prefill_attention(
    out: torch.Tensor,  # (num_tokens, heads, value dim): the chunks' rows written
    q: torch.Tensor,  # (num_tokens, heads, head_dim)
    k: torch.Tensor,  # (num_tokens, kv_heads, head_dim): the step's own, as stored
    v: torch.Tensor,  # (num_tokens, kv_heads, value dim)
    flat_k: torch.Tensor,  # the cache's keys and values (``cache_views``)
    flat_v: torch.Tensor,
    prefills: list[PrefillChunk],
    scale: float,
    prefill_bf16: bool = False,
) -> None:
    """Causal attention of each prefill chunk over its cached prefix and itself: the
    native kernel where it runs (fp32 on CPU; a latent cache's values, a prefix of its
    keys, through the whole rows), SDPA otherwise."""
    latent = flat_v.data_ptr() == flat_k.data_ptr() and flat_v.shape[2] < flat_k.shape[2]
    for chunk in prefills:
        s, e = chunk.start, chunk.start + chunk.num_tokens
        if chunk.context_slots is None:
            keys, values = k[s:e], v[s:e]
        else:
            keys = _read(flat_k, chunk.context_slots, q.dtype)
            # A latent cache's values are its keys' first dims: gathered once.
            values = (
                keys[..., : flat_v.shape[2]]
                if latent
                else _read(flat_v, chunk.context_slots, q.dtype)
            )
        if chunk.spans:  # rows that see each other both ways: an explicit mask
            mask = chunk.window_mask(None, q.device)[1]
        elif _native_chunk(out[s:e], q[s:e], keys, values, scale, prefill_bf16):
            continue
        else:
            mask = chunk.mask
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0),  # (1, heads, len, dim)
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[s:e] = o[0].transpose(0, 1)


class TorchSDPABackend(AttentionBackend):
    """The functions above as a backend: runs on any device and dtype (the fallback).

    ``prefill_bf16``: set when the model's prefill GEMMs compute in bf16 (the gguf path's
    ``VLLM_CPU_GGUF_PREFILL_DTYPE``); then prefill chunks may take the native kernel's bf16
    products. Decodes and the SDPA fallback stay in the cache's dtype."""

    name = "TORCH_SDPA"
    priority = 0
    decodes_first = True
    supported_features: ClassVar[frozenset[str]] = frozenset(
        {
            "sliding_window",
            "logits_soft_cap",
            "sinks",
            "fp8_kv_cache",
            "latent_kv",
            "bidirectional_spans",
            "indexed_reads",
        }
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prefill_bf16 = False

    def use_prefill_dtype(self, dtype: torch.dtype | None) -> None:
        self.prefill_bf16 = dtype == torch.bfloat16

    @property
    def detail(self) -> str:
        return "bf16 prefill products" if self.prefill_bf16 else ""

    def build_metadata(self, seqs: list[SeqLayout]) -> AttentionMetadata:
        return build_metadata(seqs, self.block_size, self.device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention(
            q, k, v, kv_cache, meta, scale, self.prefill_bf16, sliding_window, logits_soft_cap,
            sinks, self.value_size,
        )  # fmt: skip
