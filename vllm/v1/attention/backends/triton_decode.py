"""Paged decode attention in Triton: one query token per sequence over the paged KV cache.

``paged_decode_attention`` reads the cache in place, ``(2, num_blocks, block_size,
kv_heads, head_dim)`` per layer, through ``block_table`` and ``seq_lens``; nothing is
gathered. One program per (sequence, KV head, split) holds that KV head's whole group of
query heads (GQA: query head ``h`` reads KV head ``h // (heads // kv_heads)``), so every KV
tile is read once per group. It walks its sequence in tiles of ``TILE_N`` token positions,
each position's block looked up in the block table (so a tile may span blocks, and any
block size works), with an online softmax in fp32; positions at or past ``seq_len`` are
masked, never read, so padded or null block-table entries past the context are harmless.
A sliding window (``window > 0``: the query sees its last ``window`` positions, itself
included) starts the walk at the window's first tile and masks the positions before it.
Soft-capped scores (``soft_cap > 0``, Gemma 2: ``cap * tanh(s / cap)`` before the mask)
and attention sinks (``sinks``, gpt-oss: one logit per query head that joins the softmax's
denominator and contributes no value) are each a compile-time variant, so a model without
them runs the kernel it always ran. An FP8 cache (``--kv-cache-dtype``) is read as its
bytes and decoded in registers (``KV_FP8``: e4m3fn's or e5m2's bits into fp32, exactly).

The launch grid is ``(num_seqs, kv_heads, num_splits)``, fixed by the batch's shape: the
context lengths are read by the kernel from device memory, never by the host, so a call
can be captured in a CUDA graph and replayed with new lengths and block tables copied into
the same tensors. ``num_splits > 1`` (split-K, for batches too small to fill the GPU) cuts
each context into ``num_splits`` ranges whose partial (max, sum, output) a second kernel
combines; it depends on the batch size only, never on the lengths.

Inputs are fp16, bf16 or fp32; products and the softmax are fp32. fp16/bf16 tiles are
widened to fp32 and multiplied at TF32 input precision, which holds fp16's and bf16's
mantissas exactly (only the probabilities are rounded, to 10 bits, as a half-precision
kernel rounds them); fp32 inputs multiply at full IEEE precision.

Triton is optional: without it this module still imports (``triton_unavailable_reason``
says why it cannot run). Tests run the same kernel on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported).
"""

from __future__ import annotations

import functools
import math

import torch

from vllm.v1.attention.kv_cache_dtype import fp8_kind, is_fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the backend falls back to varlen_attn
    triton = None
    tl = None

LOG2E = math.log2(math.e)
MAX_SPLITS = 16
MIN_DOT = 16  # tl.dot's smallest M, N and K
TILE_ELEMENTS = 4096  # one K (or V) tile of TILE_N x head_dim, widened to fp32


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None: it can)."""
    if triton is None:
        return "triton is not installed"
    if device.type != "cuda":
        return f"the Triton decode kernel runs on CUDA, not {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_partials(
    out: torch.Tensor, num_seqs: int, heads: int, num_splits: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A split-K decode's fp32 partials, combined after the splits: each (sequence, head,
    split)'s running max and denominator and its unscaled ``width``-wide output; ``out``
    three times (unused pointers) when the kernel does not split."""
    if num_splits == 1:
        return out, out, out
    m_part = torch.empty(num_seqs, heads, num_splits, dtype=torch.float32, device=out.device)
    acc_part = torch.empty(*m_part.shape, width, dtype=torch.float32, device=out.device)
    return m_part, torch.empty_like(m_part), acc_part


def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per context so that the grid has about one program per SM: a power of two
    up to ``MAX_SPLITS``, from the batch's shape only (so a captured graph stays valid)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 1
    programs = max(num_seqs * num_kv_heads, 1)
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return min(MAX_SPLITS, _next_power_of_2(-(-sms // programs)))


def split_variants(max_num_seqs: int, num_kv_heads: int, device: torch.device) -> dict[int, int]:
    """Each number of splits that a batch of 1 to ``max_num_seqs`` decodes launches with
    (``default_num_splits``), and the smallest such batch."""
    variants: dict[int, int] = {}
    for n in range(1, max(max_num_seqs, 1) + 1):
        variants.setdefault(default_num_splits(n, num_kv_heads, device), n)
    return variants


def warm_up(
    kv_cache: torch.Tensor,
    num_heads: int,
    max_num_seqs: int,
    soft_cap: bool = False,
    sinks: bool = False,
) -> int:
    """Compile the kernel (and the combine of split-K) before the first request needs it:
    Triton compiles a kernel per set of constexprs on its first launch, here one per
    number of splits and with or without query rows (a mixed step's decodes; a CUDA graph
    captures decode-only steps of its ladder's sizes alone). On a fresh machine each took
    about a second inside the first steps that met it: a study's first server ran 110
    prompt tokens/s in its first 10 s against ~4,000 for the next (H200,
    docs/experiments.md). One small launch per variant on ``kv_cache``'s null block 0 (read,
    never written), soft-capped and with sinks (in the cache's dtype) where the model's
    layers use them. Returns the number of launches."""
    device, kv_heads, dim = kv_cache.device, kv_cache.shape[3], kv_cache.shape[4]
    extra = {"soft_cap": 1.0 if soft_cap else 0.0}
    if sinks:
        extra["sinks"] = torch.zeros(num_heads, dtype=kv_cache.dtype, device=device)
    launches = 0
    for splits, n in split_variants(max_num_seqs, kv_heads, device).items():
        q = torch.zeros(n, num_heads, dim, dtype=kv_cache.dtype, device=device)
        table = torch.zeros(n, 1, dtype=torch.int32, device=device)  # the metadata's dtypes
        lens = torch.ones(n, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        for rows in (None, torch.arange(n, dtype=torch.int32, device=device)):
            paged_decode_attention(q, kv_cache, table, lens, 1.0, out, rows, splits, **extra)
            launches += 1
    return launches


def kv_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as the kernels take it: an FP8 cache as its bytes (``KV_FP8`` decodes
    them), any other as it is."""
    return kv_cache.view(torch.uint8) if is_fp8(kv_cache.dtype) else kv_cache


def check_features(q: torch.Tensor, soft_cap: float, sinks: torch.Tensor | None) -> None:
    """``soft_cap`` and ``sinks`` as the kernels take them (host metadata only)."""
    if not soft_cap >= 0 or math.isinf(soft_cap):
        raise ValueError(f"soft_cap={soft_cap}: 0 (none) or a positive finite cap")
    if sinks is not None:
        if sinks.shape != (q.shape[1],) or sinks.device != q.device:
            raise ValueError(
                f"sinks {tuple(sinks.shape)} on {sinks.device}: one per query head "
                f"({q.shape[1]}) on {q.device}"
            )
        if sinks.stride(0) != 1:
            raise ValueError("sinks must be contiguous")


def check_paged_args(q, kv_cache, block_table, seq_lens, out, window, **indices) -> None:
    """What the paged kernels (this one, ``triton_prefill``'s) share: shapes, dtypes and
    layouts of q / the cache / out / the block table and lengths, the int dtypes of the
    named ``indices`` too, and the window (host metadata only: no device read)."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"q {tuple(q.shape)} / kv_cache {tuple(kv_cache.shape)}: bad rank")
    heads, kv_heads, dim = q.shape[1], kv_cache.shape[3], q.shape[2]
    if heads % kv_heads or kv_cache.shape[4] != dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    cache_ok = kv_cache.dtype == q.dtype or is_fp8(kv_cache.dtype)  # FP8: read as bytes
    if not cache_ok or out.dtype != q.dtype or out.shape != q.shape:
        raise ValueError(f"q {q.dtype}, kv_cache {kv_cache.dtype}, out {out.dtype} differ")
    num_seqs = block_table.shape[0]
    if block_table.dim() != 2 or seq_lens.shape != (num_seqs,):
        raise ValueError(f"block_table {tuple(block_table.shape)}, seq_lens {seq_lens.shape}")
    for name, t in {"block_table": block_table, "seq_lens": seq_lens, **indices}.items():
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, not {t.dtype}")
    if any(t.stride(-1) != 1 for t in (q, kv_cache, out)):
        raise ValueError("q, kv_cache and out need a contiguous last dimension")
    if block_table.shape[1] and block_table.stride(-1) != 1:
        raise ValueError("block_table needs contiguous rows")
    if window < 0:
        raise ValueError(f"window={window}: 0 (the whole context) or a positive length")


def _check_args(q, kv_cache, block_table, seq_lens, out, rows, num_splits, window=0) -> None:
    """``check_paged_args``, the query rows and the splits."""
    check_paged_args(q, kv_cache, block_table, seq_lens, out, window, rows=rows)
    num_seqs = block_table.shape[0]
    if rows is not None and rows.shape != (num_seqs,):
        raise ValueError(f"rows {tuple(rows.shape)} for {num_seqs} sequences")
    if rows is None and num_seqs > q.shape[0]:
        raise ValueError(f"{num_seqs} sequences but {q.shape[0]} query rows")
    if num_splits < 1 or num_splits & (num_splits - 1) or num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits={num_splits}: a power of two up to {MAX_SPLITS}")


def paged_decode_attention(
    q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    block_table: torch.Tensor,  # (num_seqs, max_blocks) int32, padded with any block id
    seq_lens: torch.Tensor,  # (num_seqs,) int32: keys per sequence, its own token included
    scale: float,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,  # (num_heads,): each query head's sink logit
) -> torch.Tensor:
    """Attention of sequence ``i``'s one query, ``q[rows[i]]`` (``q[i]`` when ``rows`` is
    None), over its ``seq_lens[i]`` cached keys (its last ``window`` of them when ``window``
    > 0), scores soft-capped at ``soft_cap`` when it is > 0 and each head's ``sinks`` logit
    joining its softmax; written to ``out`` at the same row, which is returned (allocated
    like ``q`` when None). Other rows of ``out`` are not touched; a sequence of length 0 (a
    padding row) gets zeros. Reads no device value on the host."""
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton (pip install triton)")
    out = torch.empty_like(q) if out is None else out
    num_seqs, kv_heads = block_table.shape[0], kv_cache.shape[3]
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, kv_heads, q.device)
    _check_args(q, kv_cache, block_table, seq_lens, out, rows, num_splits, window)
    check_features(q, soft_cap, sinks)
    if num_seqs == 0:
        return out
    heads, dim, block_size = q.shape[1], q.shape[2], kv_cache.shape[2]
    group = heads // kv_heads
    dim_pad = max(MIN_DOT, _next_power_of_2(dim))
    tile_n = max(MIN_DOT, min(64, TILE_ELEMENTS // dim_pad))
    m_part, l_part, acc_part = split_partials(out, num_seqs, heads, num_splits, dim_pad)
    rows_arg = seq_lens if rows is None else rows  # unused pointer without rows
    sinks_arg = seq_lens if sinks is None else sinks  # unused pointer without sinks
    _decode_kernel[(num_seqs, kv_heads, num_splits)](
        q, kv_bytes(kv_cache), block_table, seq_lens, rows_arg, sinks_arg, out,
        m_part, l_part, acc_part,
        scale * LOG2E, window, soft_cap * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=max(MIN_DOT, _next_power_of_2(group)),
        HEAD_DIM=dim,
        HEAD_DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        HAS_ROWS=rows is not None,
        HAS_SOFT_CAP=soft_cap > 0,
        HAS_SINKS=sinks is not None,
        KV_FP8=fp8_kind(kv_cache.dtype),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, heads)](
            m_part, l_part, acc_part, rows_arg, sinks_arg, out,
            out.stride(0), out.stride(1),
            HEAD_DIM=dim,
            HEAD_DIM_PAD=dim_pad,
            NUM_SPLITS=num_splits,
            HAS_ROWS=rows is not None,
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def soft_capped(s, cap2):
        """Base-2 scores ``s`` (natural scores times log2(e)) soft-capped at ``cap2`` (the
        cap times log2(e)): ``cap * tanh(x / cap)`` in natural units, whose tanh is
        ``1 - 2 / (e^(2t) + 1)`` (exp2's overflow to inf gives exactly 1)."""
        e2t = tl.exp2(s / cap2 * 2.885390081777927)  # e^(2t), t = x / cap: 2 log2(e)
        return cap2 * (1.0 - 2.0 / (e2t + 1.0))

    @triton.jit
    def kv_values(ptrs, mask, KV_FP8: tl.constexpr):
        """K or V elements at ``ptrs`` as fp32 (0 where masked): loaded, or with ``KV_FP8``
        the cache's bytes decoded exactly: 1, e4m3fn (bias 7; its exponent 0 is subnormal,
        m x 2^-9); 2, e5m2 (the high byte of an fp16). Stored values are never NaN."""
        if KV_FP8 == 0:
            return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        if KV_FP8 == 1:
            sign = (b >> 7) << 31
            e = (b >> 3) & 15
            m = b & 7
            normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
            sub = m.to(tl.float32) * 0.001953125  # m x 2^-9
            return tl.where(e == 0, tl.where(sign != 0, -sub, sub), normal)
        return (b << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def kv_tile(kv_head_ptr, bt_row, pos, readable, d, d_mask,
                stride_kv_half, stride_kv_block, stride_kv_slot,
                BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr):  # fmt: skip
        """(K, V) fp32 tiles (positions x head dims) of one KV head at positions ``pos``,
        each looked up in the sequence's block table row ``bt_row``; zeros where not
        ``readable`` (never loaded)."""
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=readable, other=0).to(tl.int64)
        slot = block * stride_kv_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_kv_slot
        kv_off = slot[:, None] + d[None, :]
        kv_mask = readable[:, None] & d_mask[None, :]
        k = kv_values(kv_head_ptr + kv_off, kv_mask, KV_FP8)
        v = kv_values(kv_head_ptr + stride_kv_half + kv_off, kv_mask, KV_FP8)
        return k, v

    @triton.jit
    def sunk(m_i, l_i, acc, sinks_ptr, heads, mask):
        """(m, l, acc) with each head's sink logit joined to the softmax's running max and
        denominator (natural logits; the state is base 2); the sink adds no value."""
        sink = tl.load(sinks_ptr + heads, mask=mask, other=float("-inf")).to(tl.float32)
        sink *= 1.4426950408889634  # log2(e)
        m_new = tl.maximum(m_i, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        l_new = l_i * alpha + tl.exp2(sink - m_safe)
        return m_new, l_new, acc * alpha[:, None]

    # The block table's row stride is its width, the longest context's blocks: Triton
    # would compile a variant for each of its divisibility classes (by 16 or not) in eager
    # steps; the address arithmetic gains nothing measurable from knowing it.
    # ``window`` likewise: one compiled variant serves every layer, windowed or not.
    @triton.jit(do_not_specialize=["stride_bt_seq", "window"])
    def _decode_kernel(
        q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, rows_ptr, sinks_ptr, out_ptr,
        m_ptr, l_ptr, acc_ptr,
        qk_scale,  # the softmax scale times log2(e): the softmax runs in base 2
        window,  # > 0: the last `window` positions only; 0: the whole context
        soft_cap2,  # the soft cap times log2(e) (HAS_SOFT_CAP)
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_kv_half, stride_kv_block, stride_kv_slot, stride_kv_head,
        stride_bt_seq,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr,
        HAS_SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, KV_FP8: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        if HAS_ROWS:
            row = tl.load(rows_ptr + seq).to(tl.int64)
        else:
            row = seq.to(tl.int64)
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)

        g = tl.arange(0, GROUP_PAD)  # the group's query heads, padded to a dot's M
        d = tl.arange(0, HEAD_DIM_PAD)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kv_head * GROUP + g
        gd_mask = g_mask[:, None] & d_mask[None, :]
        q_off = row * stride_q_tok + heads[:, None] * stride_q_head + d[None, :]
        q = tl.load(q_ptr + q_off, mask=gd_mask, other=0.0).to(tl.float32)

        # The positions it attends to: [first, seq_len). Its tiles, from the one holding
        # `first` to cdiv(seq_len, TILE_N), are shared among the splits; this split's are
        # [tile_lo, tile_hi). Each holds at least one position of the range.
        first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
        first_tile = first // TILE_N
        num_tiles = tl.cdiv(seq_len, TILE_N) - first_tile
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = first_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, first_tile + num_tiles)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt_seq
        kv_head_ptr = kv_ptr + kv_head.to(tl.int64) * stride_kv_head
        offs = tl.arange(0, TILE_N)
        for t in range(tile_lo, tile_hi):
            pos = t * TILE_N + offs
            valid = (pos < seq_len) & (pos >= first)  # every tile has one
            k, v = kv_tile(kv_head_ptr, bt_row, pos, valid, d, d_mask, stride_kv_half,
                           stride_kv_block, stride_kv_slot, BLOCK_SIZE, KV_FP8)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # (G, TILE_N)
            if HAS_SOFT_CAP:
                s = soft_capped(s, soft_cap2)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pv = tl.dot(p, v, input_precision=PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if NUM_SPLITS == 1:
            if HAS_SINKS:
                m_i, l_i, acc = sunk(m_i, l_i, acc, sinks_ptr, heads, g_mask)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # seq_len 0: zeros
            o_off = row * stride_o_tok + heads[:, None] * stride_o_head + d[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=gd_mask)
        else:  # partials at [seq, head, split]; an empty split leaves (-inf, 0, 0)
            num_heads = tl.num_programs(1) * GROUP
            part = (seq.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
            tl.store(m_ptr + part, m_i, mask=g_mask)
            tl.store(l_ptr + part, l_i, mask=g_mask)
            tl.store(acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=gd_mask)

    @triton.jit
    def _combine_splits_kernel(
        m_ptr, l_ptr, acc_ptr, rows_ptr, sinks_ptr, out_ptr,
        stride_o_tok, stride_o_head,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        NUM_SPLITS: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        head = tl.program_id(1)
        if HAS_ROWS:
            row = tl.load(rows_ptr + seq).to(tl.int64)
        else:
            row = seq.to(tl.int64)
        sp = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, HEAD_DIM_PAD)
        part = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + sp
        m = tl.load(m_ptr + part)
        m_max = tl.max(m, axis=0)
        if HAS_SINKS:  # the head's sink joins the max and the denominator (base 2)
            sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
            m_max = tl.maximum(m_max, sink)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # seq_len 0: every split empty
        w = tl.exp2(m - m_max)  # an empty split weighs 0
        denom = tl.sum(w * tl.load(l_ptr + part), axis=0)
        if HAS_SINKS:
            denom += tl.exp2(sink - m_max)
        acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :])
        out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom > 0, denom, 1.0)
        o_off = row * stride_o_tok + head * stride_o_head + d
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
