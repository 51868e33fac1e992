"""Paged decode attention in Triton for multi-head latent attention (MLA: DeepSeek-V2/V3):
many query heads, one new token each, over one cached latent row per token.

The latent cache, ``(1, num_blocks, block_size, 1, LATENT + ROPE)`` per layer (keys only,
backends/abstract.py), holds each token's ``[c_kv | k_pe]``; a query head's absorbed
query is ``[q_latent | q_pe]`` of the same width (models/deepseek_v2.py). A head's score
over a token is the dot product with the whole row, ``q_latent . c_kv + q_pe . k_pe``,
and its value is the row's first ``LATENT`` dims, ``c_kv``. One tile of rows is therefore
read once and serves both products: ``QK^T`` over the latent and rotated parts, ``PV``
over the latent part. Nothing is gathered: positions are looked up in the block table, so
a tile may span blocks and any block size works; positions at or past ``seq_len`` are
masked, never read.

Why a kernel of its own rather than ``triton_decode``'s with a 576-wide head: that one
loads a K and a V tile of the head's width and writes a head as wide as the key; here V
is a prefix of K (no second load), the output is ``LATENT`` wide, and the GQA group is
every query head (16 for V2-Lite, 128 for V3) over a single KV head. A program takes a
tile of ``BLOCK_H`` query heads (``tl.dot``'s M) and walks its sequence in tiles of
``TILE_N`` positions with an online softmax in fp32 (base 2); the grid is
``(num_seqs, cdiv(heads, BLOCK_H), num_splits)``. Split-K (``num_splits > 1``, for
batches too small to fill the GPU) cuts each context into ranges whose partial (max,
sum, output) ``triton_decode``'s combine kernel merges: the partials share its layout.

As ``triton_decode``: the launch shapes depend on the batch's shape only (the lengths are
read by the kernel from device memory), so a decode step can be captured in a CUDA graph
and replayed with new lengths and tables copied in; fp16/bf16 tiles are widened to fp32
and multiplied at TF32 input precision (exact for their mantissas; the probabilities are
rounded to 10 bits), fp32 at IEEE precision; an FP8 cache is read as its bytes and
decoded in registers (``KV_FP8``). Sequence ``i`` reads query row ``i`` and writes output
row ``i``: the decodes are the batch's first rows (the backend orders them so).

Triton is optional: without it this module still imports. Tests run the kernel on CPU
tensors in Triton's interpreter (``tests/v1/attention/test_triton_mla_decode.py``).
"""

from __future__ import annotations

import torch

from vllm.v1.attention.backends.triton_decode import (
    LOG2E,
    MIN_DOT,
    _next_power_of_2,
    default_num_splits,
    kv_bytes,
    split_partials,
    split_variants,
    triton,
    triton_unavailable_reason,
)
from vllm.v1.attention.kv_cache_dtype import fp8_kind, is_fp8

if triton is not None:
    import triton.language as tl

    from vllm.v1.attention.backends.triton_decode import _combine_splits_kernel, kv_values

__all__ = ["mla_decode_attention", "triton_unavailable_reason", "warm_up"]

BLOCK_H = MIN_DOT  # query heads per program: tl.dot's smallest M
TILE_ELEMENTS = 4096  # one tile of TILE_N x latent dims, widened to fp32


def _check_args(q, kv_cache, block_table, seq_lens, out, value_size, num_splits) -> None:
    """Shapes, dtypes and layouts (host metadata only: no device read)."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(
            f"q {tuple(q.shape)} / kv_cache {tuple(kv_cache.shape)}: expected (tokens, heads, "
            "dim) and a latent cache (1, blocks, block_size, 1, dim)"
        )
    dim = q.shape[2]
    if kv_cache.shape[4] != dim or not 0 < value_size < dim:
        raise ValueError(f"q {tuple(q.shape)}, kv_cache {tuple(kv_cache.shape)}, {value_size=}")
    if not (kv_cache.dtype == q.dtype or is_fp8(kv_cache.dtype)) or out.dtype != q.dtype:
        raise ValueError(f"q {q.dtype}, kv_cache {kv_cache.dtype}, out {out.dtype} differ")
    num_seqs = block_table.shape[0]
    if out.shape[1:] != (q.shape[1], value_size) or min(q.shape[0], out.shape[0]) < num_seqs:
        raise ValueError(f"out {tuple(out.shape)} for q {tuple(q.shape)} and {num_seqs} rows")
    if block_table.dim() != 2 or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_table {tuple(block_table.shape)}, seq_lens {seq_lens.shape}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, not {t.dtype}")
    if any(t.stride(-1) != 1 for t in (q, kv_cache, out)):
        raise ValueError("q, kv_cache and out need a contiguous last dimension")
    if block_table.shape[1] and block_table.stride(-1) != 1:
        raise ValueError("block_table needs contiguous rows")
    if num_splits < 1 or num_splits & (num_splits - 1) or num_splits > 16:
        raise ValueError(f"num_splits={num_splits}: a power of two up to 16")


def mla_decode_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, LATENT + ROPE): [q_latent | q_pe] per head
    kv_cache: torch.Tensor,  # (1, num_blocks, block_size, 1, LATENT + ROPE)
    block_table: torch.Tensor,  # (num_seqs, max_blocks) int32, padded with any block id
    seq_lens: torch.Tensor,  # (num_seqs,) int32: keys per sequence, its own included
    scale: float,
    value_size: int,  # LATENT: a value is its row's first value_size dims
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, value_size)
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of sequence ``i``'s one query, ``q[i]``, over its ``seq_lens[i]`` cached
    latent rows (scores over the whole row, values its first ``value_size`` dims), written
    to ``out[i]``, which is returned (allocated when None). Rows of ``out`` past the
    sequences are not touched; a sequence of length 0 gets zeros. Reads no device value
    on the host."""
    if triton is None:
        raise RuntimeError("mla_decode_attention needs triton (pip install triton)")
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], value_size)
    num_seqs, heads = block_table.shape[0], q.shape[1]
    head_tiles = triton.cdiv(heads, BLOCK_H)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, head_tiles, q.device)
    _check_args(q, kv_cache, block_table, seq_lens, out, value_size, num_splits)
    if num_seqs == 0:
        return out
    rope = q.shape[2] - value_size
    latent_pad = max(MIN_DOT, _next_power_of_2(value_size))
    tile_n = max(MIN_DOT, min(64, TILE_ELEMENTS // latent_pad))
    m_part, l_part, acc_part = split_partials(out, num_seqs, heads, num_splits, latent_pad)
    _mla_decode_kernel[(num_seqs, head_tiles, num_splits)](
        q, kv_bytes(kv_cache), block_table, seq_lens, out, m_part, l_part, acc_part,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=heads,
        BLOCK_H=BLOCK_H,
        LATENT=value_size,
        LATENT_PAD=latent_pad,
        ROPE=rope,
        ROPE_PAD=max(MIN_DOT, _next_power_of_2(rope)),
        BLOCK_SIZE=kv_cache.shape[2],
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        KV_FP8=fp8_kind(kv_cache.dtype),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, heads)](
            m_part, l_part, acc_part, seq_lens, seq_lens, out,  # no rows, no sinks
            out.stride(0), out.stride(1),
            HEAD_DIM=value_size,
            HEAD_DIM_PAD=latent_pad,
            NUM_SPLITS=num_splits,
            HAS_ROWS=False,
            HAS_SINKS=False,
            num_warps=4,
        )  # fmt: skip
    return out


def warm_up(kv_cache: torch.Tensor, num_heads: int, value_size: int, max_num_seqs: int) -> int:
    """Compile the kernel (and split-K's combine) for every number of splits a batch of 1
    to ``max_num_seqs`` decodes launches with, before the first request meets one (see
    ``triton_decode.warm_up``): one small launch each on the null block 0 (read, never
    written). Returns the number of launches."""
    device = kv_cache.device
    dtype = torch.bfloat16 if is_fp8(kv_cache.dtype) else kv_cache.dtype
    head_tiles = -(-num_heads // BLOCK_H)
    launches = 0
    for splits, n in split_variants(max_num_seqs, head_tiles, device).items():
        q = torch.zeros(n, num_heads, kv_cache.shape[4], dtype=dtype, device=device)
        table = torch.zeros(n, 1, dtype=torch.int32, device=device)  # the metadata's dtypes
        lens = torch.ones(n, dtype=torch.int32, device=device)
        mla_decode_attention(q, kv_cache, table, lens, 1.0, value_size, num_splits=splits)
        launches += 1
    return launches


if triton is not None:
    # The block table's row stride is its width, the longest context's blocks: one
    # compiled variant serves every width (as triton_decode's kernel).
    @triton.jit(do_not_specialize=["stride_bt_seq"])
    def _mla_decode_kernel(
        q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, out_ptr,
        m_ptr, l_ptr, acc_ptr,
        qk_scale,  # the softmax scale times log2(e): the softmax runs in base 2
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_kv_block, stride_kv_slot,
        stride_bt_seq,
        NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
        LATENT: tl.constexpr, LATENT_PAD: tl.constexpr,
        ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, KV_FP8: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        head_tile = tl.program_id(1)
        split = tl.program_id(2)
        row = seq.to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

        heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = heads < NUM_HEADS
        dl = tl.arange(0, LATENT_PAD)  # the latent dims: keys' first part, the values
        dr = tl.arange(0, ROPE_PAD)  # the rotated key dims, after the latent
        dl_mask = dl < LATENT
        dr_mask = dr < ROPE
        q_rows = q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head
        q_lat = tl.load(q_rows + dl[None, :], mask=h_mask[:, None] & dl_mask[None, :], other=0.0)
        q_pe = tl.load(
            q_rows + LATENT + dr[None, :], mask=h_mask[:, None] & dr_mask[None, :], other=0.0
        )
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

        # This split's tiles of the context: [tile_lo, tile_hi), each with a position in it.
        num_tiles = tl.cdiv(seq_len, TILE_N)
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, LATENT_PAD], tl.float32)
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
        offs = tl.arange(0, TILE_N)
        for t in range(tile_lo, tile_hi):
            pos = t * TILE_N + offs
            valid = pos < seq_len
            block = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            slot = block * stride_kv_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_kv_slot
            # (TILE_N, LATENT_PAD): c_kv, the keys' latent part and the values at once.
            c = kv_values(kv_ptr + slot[:, None] + dl[None, :],
                          valid[:, None] & dl_mask[None, :], KV_FP8)  # fmt: skip
            k_pe = kv_values(kv_ptr + slot[:, None] + LATENT + dr[None, :],
                             valid[:, None] & dr_mask[None, :], KV_FP8)  # fmt: skip
            s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)  # (BLOCK_H, TILE_N)
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision=PRECISION)
            m_i = m_new

        hd_mask = h_mask[:, None] & dl_mask[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0: zeros
            o_off = row * stride_o_tok + heads[:, None] * stride_o_head + dl[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=hd_mask)
        else:  # partials at [seq, head, split] (the combine's layout); empty: (-inf, 0, 0)
            part = (seq.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
            tl.store(m_ptr + part, m_i, mask=h_mask)
            tl.store(l_ptr + part, l_i, mask=h_mask)
            tl.store(acc_ptr + part[:, None] * LATENT_PAD + dl[None, :], acc, mask=hd_mask)
