"""Paged prefill attention in Triton for multi-head latent attention (MLA: DeepSeek-V2/V3):
chunks of query rows, every head absorbed, over one cached latent row per token.

The latent cache and the products are ``triton_mla_decode``'s: a token's row is ``[c_kv
(LATENT) | k_pe (ROPE)]``, a head's absorbed query ``[q_latent | q_pe]`` as wide; the score
is the dot product over the whole row, the value the row's first ``LATENT`` dims. The
prefill rows come packed, sequence ``i`` owning rows ``cu_seq_q[i]:cu_seq_q[i+1]`` of ``q``
and ``out`` over its ``seq_lens[i]`` cached rows (its prefix and the chunk's own, written
before the call); the chunk's row ``j`` is position ``seq_lens[i] - q_len + j`` and sees
the keys up to itself (causal, bottom-right aligned). Nothing is gathered: positions are
looked up in the block table, any block size.

Why this tiling. Every query head reads the same latent row, so a program takes a tile of
``BLOCK_Q`` query rows x ``BLOCK_H`` heads, flattened into ``tl.dot``'s M
(``BLOCK_M = BLOCK_Q * BLOCK_H``, row-major: query row outer): each key tile of ``TILE_N``
rows x 576, read once, serves ``BLOCK_M`` score rows, and its first 512 columns are the
values of ``PV`` too. Heads fill M first (``BLOCK_H = min(BLOCK_M, heads)``, a power of
two): the heads of one query row share its causal mask and key range, so folding them in
costs no masked work, where folding query rows adds the diagonal's (up to ``BLOCK_Q - 1``
keys a row). V2-Lite's 16 heads: 2 query rows x 16 heads a program; V3's 128: one row x
32 heads, four programs a row. A per-head program (``triton_prefill``'s layout) would read
every key tile once per head (16 to 128 times); a larger M would reuse each tile more,
but its ``M x 512`` fp32 accumulator (128 registers a thread at M = 64 over 8 warps) with
the 576-wide query spills (``BLOCK_M`` below).

Each program walks its keys from position 0 to its last query row's position, ``TILE_N``
at a time, with an online softmax in fp32 (base 2). The grid is ``(cdiv(heads,
BLOCK_H), cdiv(max_q, BLOCK_Q), num_seqs)``: head tiles vary fastest, so the programs
running together share a sequence's key tiles in L2, and query tiles are taken from the
chunk's end first (the longest key ranges start first, the short ones fill the tail).
Programs past a short chunk return at once. No device value is read on the host.

Products: on CUDA, fp16/bf16 queries multiply in their own type on the tensor cores with
fp32 accumulation (``DOT16``; FP8 cache bytes decoded to fp32 and rounded to the query's
type, exactly), the probabilities rounded to it for ``PV`` as FlashAttention's; prefill
is compute-bound, and TF32 runs at half that rate. fp32 queries, and every query in
Triton's interpreter (whose numpy ``tl.dot`` gets 16-bit products wrong), are widened to
fp32 and multiplied at IEEE (fp32) or TF32 (fp16/bf16) precision, as ``triton_mla_decode``.
An FP8 cache is read as its bytes and decoded in registers (``KV_FP8``).

Triton is optional: without it this module still imports. Tests run the kernel on CPU
tensors in Triton's interpreter (``tests/v1/attention/test_triton_mla_prefill.py``).
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.triton_gemm import gemm_unavailable_reason
from vllm.v1.attention.backends.triton_decode import (
    LOG2E,
    MIN_DOT,
    _next_power_of_2,
    kv_bytes,
    triton,
)
from vllm.v1.attention.backends.triton_mla_decode import _check_args as _check_decode_args
from vllm.v1.attention.kv_cache_dtype import fp8_kind

if triton is not None:
    import triton.language as tl

    from vllm.v1.attention.backends.triton_decode import kv_values

__all__ = ["mla_prefill_attention", "prefill_unavailable_reason", "tile_shape", "warm_up"]

# The tiles, chosen on ptxas's report (no GPU timed them yet: docs/gpu.md's MLA item).
# 32 (query row, head) pairs x 512 fp32 accumulators, 16 key rows a step, 8 warps: the
# sm90 cubins of bf16 and fp32 queries spill nothing (195 and 252 registers a thread);
# 64 pairs spilled at every tile and warp count tried, as 32 at 32 key rows or 4 warps.
# An e4m3fn cache's decode (its subnormal branch) spills ~400 bytes a thread.
BLOCK_M = 32
TILE_N = 16
NUM_WARPS = 8
NUM_STAGES = {True: 2, False: 1}  # by DOT16: fp32 tiles at 2 stages pass sm80's shared memory


def prefill_unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can): CUDA with triton, or CPU
    tensors in Triton's interpreter (the tests; ``gemm_unavailable_reason``). The backend
    falls back to SDPA."""
    return gemm_unavailable_reason(device, "MLA prefill kernel")


def tile_shape(num_heads: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_H): query rows and heads a program takes (the module docstring)."""
    block_h = min(BLOCK_M, max(2, _next_power_of_2(num_heads)))
    return BLOCK_M // block_h, block_h


def _check_args(q, kv_cache, block_table, seq_lens, cu_seq_q, out, value_size) -> None:
    """``triton_mla_decode``'s checks and the chunks' offsets (host metadata only)."""
    _check_decode_args(q, kv_cache, block_table, seq_lens, out, value_size, 1)
    if cu_seq_q.shape != (block_table.shape[0] + 1,) or cu_seq_q.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"cu_seq_q {tuple(cu_seq_q.shape)} {cu_seq_q.dtype} for {block_table.shape[0]} "
            "sequences: (num_seqs + 1,) int32 or int64"
        )


def mla_prefill_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, LATENT + ROPE): [q_latent | q_pe] per head
    kv_cache: torch.Tensor,  # (1, num_blocks, block_size, 1, LATENT + ROPE)
    block_table: torch.Tensor,  # (num_seqs, max_blocks), padded with any block id
    seq_lens: torch.Tensor,  # (num_seqs,): keys per sequence, the chunk's own included
    cu_seq_q: torch.Tensor,  # (num_seqs + 1,): sequence i's rows of q and out
    max_q: int,  # the longest chunk (a host integer: the grid)
    scale: float,
    value_size: int,  # LATENT: a value is its row's first value_size dims
    out: torch.Tensor | None = None,  # (num_tokens, num_heads, value_size)
) -> torch.Tensor:
    """Causal attention of each sequence's chunk of query rows over its cached latent rows
    (see the module docstring), written to ``out``'s same rows (allocated when None; rows
    outside the chunks are not touched), which is returned. Reads no device value on the
    host."""
    if triton is None:
        raise RuntimeError("mla_prefill_attention needs triton (pip install triton)")
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], value_size)
    _check_args(q, kv_cache, block_table, seq_lens, cu_seq_q, out, value_size)
    num_seqs, heads = block_table.shape[0], q.shape[1]
    if num_seqs == 0 or max_q == 0:
        return out
    dot16 = q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cuda"
    block_q, block_h = tile_shape(heads)
    rope = q.shape[2] - value_size
    grid = (triton.cdiv(heads, block_h), triton.cdiv(max_q, block_q), num_seqs)
    _mla_prefill_kernel[grid](
        q, kv_bytes(kv_cache), block_table, seq_lens, cu_seq_q, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=heads,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        LATENT=value_size,
        LATENT_PAD=max(MIN_DOT, _next_power_of_2(value_size)),
        ROPE=rope,
        ROPE_PAD=max(MIN_DOT, _next_power_of_2(rope)),
        BLOCK_SIZE=kv_cache.shape[2],
        TILE_N=TILE_N,
        KV_FP8=fp8_kind(kv_cache.dtype),
        DOT16=dot16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES[dot16],
    )  # fmt: skip
    return out


def warm_up(kv_cache: torch.Tensor, num_heads: int, value_size: int, dtype: torch.dtype) -> None:
    """Compile the kernel for the model's queries (``dtype``) and this cache before the
    first prompt needs it: one launch of a one-row chunk over the null block 0 (read,
    never written)."""
    device = kv_cache.device
    q = torch.zeros(1, num_heads, kv_cache.shape[4], dtype=dtype, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)  # the metadata's dtypes
    lens = torch.ones(1, dtype=torch.int32, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    mla_prefill_attention(q, kv_cache, table, lens, cu, 1, 1.0, value_size)


if triton is not None:
    # One compiled variant for every block-table width (as the other paged kernels).
    @triton.jit(do_not_specialize=["stride_bt_seq"])
    def _mla_prefill_kernel(
        q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, cu_q_ptr, out_ptr,
        qk_scale,  # the softmax scale times log2(e): the softmax runs in base 2
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_kv_block, stride_kv_slot,
        stride_bt_seq,
        NUM_HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
        LATENT: tl.constexpr, LATENT_PAD: tl.constexpr,
        ROPE: tl.constexpr, ROPE_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        KV_FP8: tl.constexpr, DOT16: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        head_tile = tl.program_id(0)
        m0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_Q  # the chunk's end first
        seq = tl.program_id(2)
        q_start = tl.load(cu_q_ptr + seq).to(tl.int32)
        q_len = tl.load(cu_q_ptr + seq + 1).to(tl.int32) - q_start
        if m0 < q_len:  # else a tile past this sequence's chunk: nothing to do
            seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
            prefix = seq_len - q_len  # cached positions before the chunk
            # Flattened (query row, head) pairs: tl.dot's M.
            i = tl.arange(0, BLOCK_Q * BLOCK_H)
            r = m0 + i // BLOCK_H  # the chunk's row
            heads = head_tile * BLOCK_H + i % BLOCK_H
            row_mask = (r < q_len) & (heads < NUM_HEADS)
            q_pos = prefix + r  # each row's position in its sequence
            dl = tl.arange(0, LATENT_PAD)  # the latent dims: keys' first part, the values
            dr = tl.arange(0, ROPE_PAD)  # the rotated key dims, after the latent
            dl_mask = dl < LATENT
            dr_mask = dr < ROPE
            rows = (q_start + r).to(tl.int64)
            q_rows = q_ptr + rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head
            q_lat = tl.load(q_rows + dl[None, :], mask=row_mask[:, None] & dl_mask[None, :],
                            other=0.0)  # fmt: skip
            q_pe = tl.load(q_rows + LATENT + dr[None, :],
                           mask=row_mask[:, None] & dr_mask[None, :], other=0.0)  # fmt: skip
            if not DOT16:
                q_lat = q_lat.to(tl.float32)
                q_pe = q_pe.to(tl.float32)

            # Keys [0, last): past the tile's last row (rows past the chunk see what its last
            # row sees and are not stored). Every row sees position 0: no row is all -inf.
            last = tl.minimum(prefix + m0 + BLOCK_Q, seq_len)
            m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_Q * BLOCK_H, LATENT_PAD], tl.float32)
            bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
            offs = tl.arange(0, TILE_N)
            for t in range(0, tl.cdiv(last, TILE_N)):
                pos = t * TILE_N + offs
                readable = pos < last
                block = tl.load(bt_row + pos // BLOCK_SIZE, mask=readable, other=0).to(tl.int64)
                slot = block * stride_kv_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_kv_slot
                # (TILE_N, LATENT_PAD): c_kv, the keys' latent part and the values at once.
                c = kv_values(kv_ptr + slot[:, None] + dl[None, :],
                              readable[:, None] & dl_mask[None, :], KV_FP8)  # fmt: skip
                k_pe = kv_values(kv_ptr + slot[:, None] + LATENT + dr[None, :],
                                 readable[:, None] & dr_mask[None, :], KV_FP8)  # fmt: skip
                if DOT16:  # exact: the cache holds the query's type, or FP8
                    c = c.to(q_ptr.dtype.element_ty)
                    k_pe = k_pe.to(q_ptr.dtype.element_ty)
                    s = tl.dot(q_lat, tl.trans(c))
                    s += tl.dot(q_pe, tl.trans(k_pe))
                else:
                    s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
                    s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
                sees = readable[None, :] & (pos[None, :] <= q_pos[:, None])
                s = tl.where(sees, s * qk_scale, float("-inf"))  # (BLOCK_M, TILE_N)
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if DOT16:
                    pv = tl.dot(p.to(q_ptr.dtype.element_ty), c)
                else:
                    pv = tl.dot(p, c, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

            out = acc / l_i[:, None]
            o_off = rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head + dl[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & dl_mask[None, :])  # fmt: skip
