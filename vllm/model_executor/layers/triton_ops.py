"""The Llama family's per-layer elementwise ops as one Triton kernel each, for CUDA:
``fused_add_rms_norm`` (residual add and RMSNorm), ``rms_norm``, ``rotary_embedding`` (q and
k in one launch), ``rotary_embedding_and_cache`` (that, and this step's K/V written into
the paged cache) and ``silu_and_mul``.

In pure torch these are 3-10 kernels each, about 30 a layer: a thousand launches a decode
step on an 8B model. A CUDA graph removes the host's cost of launching them but not the
GPU's few microseconds per kernel, which at batch 1 add up to a large share of the 4.5 ms
the step's weights take to read on an H100. One kernel each leaves about a third.

Same semantics as ``vllm/_custom_ops.py``'s pure-torch versions, which the tests hold
them to: products and sums in fp32, one rounding to the tensor's dtype at each store. In
``fused_add_rms_norm`` the residual is stored rounded (as ``residual.add_(x)`` does) and
the norm is taken of that rounded value, so a step computes the same as the eager path up
to the fp32 order of summation. ``_custom_ops`` sends CUDA tensors here when triton imports
and ``VLLM_CUDA_FUSED_OPS`` is on (the default); ``0`` keeps pure torch, for comparison.

Nothing reads a device value on the host, and launch grids depend on shapes only, so a
decode step with these ops can be captured in a CUDA graph. Tests run the kernels on CPU
tensors in Triton's interpreter (``TRITON_INTERPRET=1`` before this module is imported).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: _custom_ops keeps pure torch
    triton = None
    tl = None


def _interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (tests on CPU tensors)."""
    return type(_rms_norm_kernel).__name__ == "InterpretedFunction"


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expected (rows, hidden) with a contiguous last dim, got {x.shape}")
    return x


def _launch_norm(x, residual, weight, out, eps: float) -> None:
    """The norm kernel over ``x``'s rows into ``out``; with ``residual``, first
    ``residual += x`` and the norm of that."""
    if not x.shape[0]:
        return
    res = x if residual is None else residual  # an unread pointer without a residual
    n = x.shape[1]
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=_block(n), num_warps=4 if n <= 4096 else 8,
    )  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * weight`` as a new tensor; x (rows, hidden)."""
    x = _rows(x)
    out = torch.empty_like(x)
    _launch_norm(x, None, weight, out, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual += x`` (rounded to its dtype), then ``x = rms_norm(residual) *
    weight``."""
    x, residual = _rows(x), _rows(residual)
    if x.shape != residual.shape:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    _launch_norm(x, residual, weight, x, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Neox-style rotary embedding of every head of ``query`` (T, heads * head_size) and
    ``key`` (T, kv_heads * head_size), in place; rows may be strided views (of the fused
    qkv output). ``cos_sin_cache``: (max_position, head_size) = [cos | sin]."""
    tokens = positions.shape[0]
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("query and key need a contiguous last dimension")
    if cos_sin_cache.shape[1] != head_size or head_size % 2:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} for head size {head_size}")
    q_heads, k_heads = query.shape[-1] // head_size, key.shape[-1] // head_size
    if tokens:  # the cache kernel without its cache: no v head, no slot (unread pointers)
        _rotary_cache_kernel[(tokens, q_heads + k_heads)](
            positions, query, key, key, cos_sin_cache, key, positions,
            query.stride(0), key.stride(0), 0, cos_sin_cache.stride(0), 0, q_heads, k_heads,
            HALF=head_size // 2, HALF_PAD=_block(head_size // 2), WRITE_KV=False,
            num_warps=1,
        )  # fmt: skip


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``rotary_embedding`` of ``query`` and ``key`` in place, and the rotated ``key`` and
    ``value`` (T, kv_heads * head_size) written into their paged cache slots: what
    ``rotary_embedding`` then ``reshape_and_cache_torch(..., padded=False)`` do, in one
    launch instead of three (the cache's two ``index_copy_`` took 0.15 of a batch-1 decode
    step's 4.38 ms on an H200). ``rotary_embedding`` is the same kernel without the
    cache. ``kv_cache``: (2, num_blocks, block_size, kv_heads,
    head_size), contiguous; ``slot_mapping``: (T,) int64, every slot >= 0 (from block ids;
    a CUDA graph's padding rows write slot 0 of the null block)."""
    tokens = positions.shape[0]
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("query, key and value need a contiguous last dimension")
    if cos_sin_cache.shape[1] != head_size or head_size % 2:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} for head size {head_size}")
    q_heads, kv_heads = query.shape[-1] // head_size, key.shape[-1] // head_size
    if (
        not kv_cache.is_contiguous()
        or kv_cache.shape[0] != 2
        or tuple(kv_cache.shape[3:]) != (kv_heads, head_size)
        or kv_cache.dtype != key.dtype
    ):
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype}: expected a contiguous "
            f"(2, blocks, block_size, {kv_heads}, {head_size}) {key.dtype} cache"
        )
    if tokens:
        _rotary_cache_kernel[(tokens, q_heads + 2 * kv_heads)](
            positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping,
            query.stride(0), key.stride(0), value.stride(0), cos_sin_cache.stride(0),
            kv_cache.stride(0), q_heads, kv_heads,
            HALF=head_size // 2, HALF_PAD=_block(head_size // 2), WRITE_KV=True, num_warps=1,
        )  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` as a new (..., d) tensor; x (..., 2d)."""
    d = x.shape[-1] // 2
    flat = _rows(x.reshape(-1, x.shape[-1]))
    out = torch.empty(flat.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, _block(d))
    if flat.shape[0]:
        _silu_and_mul_kernel[(flat.shape[0], triton.cdiv(d, block))](
            flat, out, flat.stride(0), out.stride(0), d, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], d)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr,
        stride_x, stride_res, stride_out, n, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)  # residual += x, rounded
            tl.store(res_ptr + row * stride_res + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = xf * rstd * w
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_cache_kernel(
        pos_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, kv_ptr, slot_ptr,
        stride_q, stride_k, stride_v, stride_cache, stride_kv, q_heads, kv_heads,
        HALF: tl.constexpr, HALF_PAD: tl.constexpr, WRITE_KV: tl.constexpr,
    ):  # fmt: skip
        # Programs (token, head): q heads rotate in place; k heads rotate in place and,
        # with WRITE_KV, into the K half of the token's slot; v heads (WRITE_KV only: the
        # grid has none otherwise) copy into the V half.
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, HALF_PAD)
        mask = d < HALF
        if head < q_heads + kv_heads:
            pos = tl.load(pos_ptr + token).to(tl.int64)
            cos = tl.load(cache_ptr + pos * stride_cache + d, mask=mask, other=0.0)
            sin = tl.load(cache_ptr + pos * stride_cache + HALF + d, mask=mask, other=0.0)
            cos, sin = cos.to(tl.float32), sin.to(tl.float32)
            if head < q_heads:
                base = q_ptr + token * stride_q + head * (2 * HALF)
            else:
                base = k_ptr + token * stride_k + (head - q_heads) * (2 * HALF)
            x1 = tl.load(base + d, mask=mask, other=0.0)
            x2 = tl.load(base + HALF + d, mask=mask, other=0.0)
            out_ty = x1.dtype
            x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
            y1 = (x1 * cos - x2 * sin).to(out_ty)
            y2 = (x2 * cos + x1 * sin).to(out_ty)
            tl.store(base + d, y1, mask=mask)
            tl.store(base + HALF + d, y2, mask=mask)
            if WRITE_KV:
                if head >= q_heads:
                    slot = tl.load(slot_ptr + token).to(tl.int64)
                    dst = kv_ptr + (slot * kv_heads + (head - q_heads)) * (2 * HALF)
                    tl.store(dst + d, y1, mask=mask)
                    tl.store(dst + HALF + d, y2, mask=mask)
        elif WRITE_KV:
            slot = tl.load(slot_ptr + token).to(tl.int64)
            j = head - q_heads - kv_heads
            src = v_ptr + token * stride_v + j * (2 * HALF)
            dst = kv_ptr + stride_kv + (slot * kv_heads + j) * (2 * HALF)
            tl.store(dst + d, tl.load(src + d, mask=mask), mask=mask)
            tl.store(dst + HALF + d, tl.load(src + HALF + d, mask=mask), mask=mask)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, d, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

else:
    _rms_norm_kernel = _rotary_cache_kernel = _silu_and_mul_kernel = None
