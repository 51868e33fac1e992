"""Paged prefill attention in Triton: query chunks over the paged KV cache, for the layers
torch's FlashAttention cannot compute (soft-capped scores, Gemma 2; attention sinks where
``varlen_attn`` returns no log-sum-exp).

``paged_prefill_attention`` takes the prefill rows packed, sequence ``i`` owning query rows
``cu_seq_q[i]:cu_seq_q[i+1]`` over its ``seq_lens[i]`` keys, its cached prefix and the
chunk's own, which are already in the cache: the layout of ``VarlenMetadata``, whose block
table it reads in place whatever the block size (nothing is gathered). The chunk's query
``j`` is position ``seq_lens[i] - q_len + j`` and sees the keys up to itself (causal,
aligned to the bottom-right corner as FlashAttention's), its last ``window`` of them when
``window > 0``; scores are soft-capped when ``soft_cap > 0``; each head's ``sinks`` logit
joins its softmax and contributes no value.

One program per (sequence, tile of ``BLOCK_M`` query rows, query head) walks the keys its
tile reaches, from the window's first (the tile's first query's) to the tile's last query,
``TILE_N`` positions at a time, each position's block looked up in the block table, with
an online softmax in fp32 (products as ``triton_decode``'s: tiles widened to fp32, TF32
input precision for fp16/bf16, IEEE for fp32). Positions outside that range are never
read. The grid is ``(num_seqs, cdiv(max_q, BLOCK_M), heads)`` from host integers; the
programs past a short sequence's rows return at once. No device value is read on the host.

A query head reads its KV head's tiles itself (GQA's group is not folded into one program,
as ``triton_decode`` folds it): the simple layout first; what it costs against FlashAttention
on a GPU is for a GPU session to measure (docs/gpu.md).
"""

from __future__ import annotations

import torch

from vllm.v1.attention.backends.triton_decode import (
    LOG2E,
    MIN_DOT,
    _next_power_of_2,
    check_features,
    check_paged_args,
    kv_bytes,
    triton,
    triton_unavailable_reason,
)
from vllm.v1.attention.kv_cache_dtype import fp8_kind

if triton is not None:
    import triton.language as tl

    from vllm.v1.attention.backends.triton_decode import kv_tile, soft_capped, sunk

__all__ = ["paged_prefill_attention", "triton_unavailable_reason"]

TILE_ELEMENTS = 4096  # one K (or V) tile of TILE_N x head_dim, widened to fp32


def _check_args(q, kv_cache, block_table, seq_lens, cu_seq_q, out, window) -> None:
    """``check_paged_args`` and the chunks' offsets (host metadata only)."""
    check_paged_args(q, kv_cache, block_table, seq_lens, out, window, cu_seq_q=cu_seq_q)
    if cu_seq_q.shape != (block_table.shape[0] + 1,):
        raise ValueError(f"cu_seq_q {tuple(cu_seq_q.shape)} for {block_table.shape[0]} sequences")


def paged_prefill_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim): the sequences' rows, packed
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (num_seqs, max_blocks), padded with any block id
    seq_lens: torch.Tensor,  # (num_seqs,): keys per sequence, the chunk's own included
    cu_seq_q: torch.Tensor,  # (num_seqs + 1,): sequence i's rows of q
    max_q: int,  # the longest chunk (a host integer: the grid)
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,  # (num_heads,): each query head's sink logit
) -> torch.Tensor:
    """Causal attention of each sequence's chunk of queries over its cached context (see
    the module docstring), written to ``out`` (allocated like ``q`` when None), which is
    returned. Reads no device value on the host."""
    if triton is None:
        raise RuntimeError("paged_prefill_attention needs triton (pip install triton)")
    out = torch.empty_like(q) if out is None else out
    _check_args(q, kv_cache, block_table, seq_lens, cu_seq_q, out, window)
    check_features(q, soft_cap, sinks)
    num_seqs = block_table.shape[0]
    if num_seqs == 0 or max_q == 0:
        return out
    heads, dim, block_size = q.shape[1], q.shape[2], kv_cache.shape[2]
    dim_pad = max(MIN_DOT, _next_power_of_2(dim))
    tile_n = max(MIN_DOT, min(64, TILE_ELEMENTS // dim_pad))
    block_m = max(MIN_DOT, min(64, TILE_ELEMENTS // dim_pad))
    sinks_arg = seq_lens if sinks is None else sinks  # unused pointer without sinks
    grid = (num_seqs, triton.cdiv(max_q, block_m), heads)
    _prefill_kernel[grid](
        q, kv_bytes(kv_cache), block_table, seq_lens, cu_seq_q, sinks_arg, out,
        scale * LOG2E, window, soft_cap * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        GROUP=heads // kv_cache.shape[3],
        HEAD_DIM=dim,
        HEAD_DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        HAS_SOFT_CAP=soft_cap > 0,
        HAS_SINKS=sinks is not None,
        KV_FP8=fp8_kind(kv_cache.dtype),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip
    return out


if triton is not None:
    # As in triton_decode: one compiled variant for every block-table width and window.
    @triton.jit(do_not_specialize=["stride_bt_seq", "window"])
    def _prefill_kernel(
        q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, cu_q_ptr, sinks_ptr, out_ptr,
        qk_scale,  # the softmax scale times log2(e): the softmax runs in base 2
        window,  # > 0: each query's last `window` positions only; 0: its whole prefix
        soft_cap2,  # the soft cap times log2(e) (HAS_SOFT_CAP)
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_kv_half, stride_kv_block, stride_kv_slot, stride_kv_head,
        stride_bt_seq,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
        HAS_SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        m0 = tl.program_id(1) * BLOCK_M
        head = tl.program_id(2)
        q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
        q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_start
        if m0 < q_len:  # else a tile past this sequence's chunk: nothing to do
            seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
            prefix = seq_len - q_len  # cached positions before the chunk
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_mask = offs_m < q_len
            q_pos = prefix + offs_m  # each row's position in its sequence
            d = tl.arange(0, HEAD_DIM_PAD)
            d_mask = d < HEAD_DIM
            md_mask = m_mask[:, None] & d_mask[None, :]
            rows = (q_start + offs_m).to(tl.int64)
            q_off = rows[:, None] * stride_q_tok + head * stride_q_head + d[None, :]
            q = tl.load(q_ptr + q_off, mask=md_mask, other=0.0).to(tl.float32)

            # The keys the tile reaches: [first, last). `last`: past its last query (rows
            # past the chunk see what the chunk's last row sees, and are not stored).
            last = tl.minimum(prefix + m0 + BLOCK_M, seq_len)
            first = tl.where(window > 0, tl.maximum(prefix + m0 - window + 1, 0), 0)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
            bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
            kv_head_ptr = kv_ptr + (head // GROUP).to(tl.int64) * stride_kv_head
            offs_n = tl.arange(0, TILE_N)
            for t in range(first // TILE_N, tl.cdiv(last, TILE_N)):
                pos = t * TILE_N + offs_n
                readable = (pos >= first) & (pos < last)
                k, v = kv_tile(kv_head_ptr, bt_row, pos, readable, d, d_mask, stride_kv_half,
                               stride_kv_block, stride_kv_slot, BLOCK_SIZE, KV_FP8)  # fmt: skip
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (M, N)
                if HAS_SOFT_CAP:
                    s = soft_capped(s, soft_cap2)
                sees = readable[None, :] & (pos[None, :] <= q_pos[:, None])
                sees &= (window <= 0) | (pos[None, :] > q_pos[:, None] - window)
                s = tl.where(sees, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                # A row may see nothing in this tile yet (its window starts later).
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                pv = tl.dot(p, v, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

            if HAS_SINKS:
                heads = tl.zeros([BLOCK_M], tl.int32) + head
                m_i, l_i, acc = sunk(m_i, l_i, acc, sinks_ptr, heads, m_mask)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_off = rows[:, None] * stride_o_tok + head * stride_o_head + d[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=md_mask)
