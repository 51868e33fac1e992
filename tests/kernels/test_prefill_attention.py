"""The native prefill attention (csrc/cpu/prefill_attention.cpp) equals torch SDPA: fp32 up
to float rounding (AVX-512 or AVX2 + FMA), bf16 products within bf16's error (AVX512_BF16
only); on strided q/k/v views of a fused qkv output, GQA and MHA, with and without a cached
prefix (causal offset), and through ``paged_attention`` (a whole prompt, then a chunk after
a cached prefix). The native build is slow: marked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import require_native
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.torch_sdpa import (
    build_metadata,
    native_prefill_attention,
    paged_attention,
)

pytestmark = pytest.mark.slow
G = torch.Generator().manual_seed(0)


def supported(bf16: bool) -> bool:
    """Whether this CPU runs the native kernel (fp32: AVX-512 or AVX2 + FMA; bf16:
    AVX512_BF16)."""
    q = torch.zeros(1, 1, 64)
    return native_prefill_attention(torch.empty_like(q), q, q, q, 1.0, bf16=bf16)


@pytest.fixture(scope="module", autouse=True)
def native():
    require_native(lambda: ops._op("prefill_attention") is not None)
    if not supported(bf16=False):
        pytest.skip("neither AVX-512 nor AVX2 + FMA on this CPU")


def qkv_views(ctx: int, heads: int, kv_heads: int, head_dim: int):
    """q, k, v: (ctx, heads, dim) column views of one fused (ctx, (heads + 2 kv) dim) tensor."""
    qkv = torch.randn(ctx, (heads + 2 * kv_heads) * head_dim, generator=G)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (
        q.view(ctx, heads, head_dim),
        k.view(ctx, kv_heads, head_dim),
        v.view(ctx, kv_heads, head_dim),
    )


def sdpa(q, k, v, scale):
    """Reference: the last len(q) positions of a len(k) context, causal with offset."""
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(k.shape[0] - q.shape[0])
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(0, 1)


SHAPES = [(9, 3, 64), (4, 4, 64), (8, 2, 128)]
LENGTHS = [1, 15, 16, 17, 100, 513]
OFFSETS = [0, 37]


def chunk(heads, kv_heads, head_dim, length, offset):
    """q: the last ``length`` positions of a ``length + offset`` context; SDPA's output."""
    q, k, v = qkv_views(length + offset, heads, kv_heads, head_dim)
    q = q[offset:]
    return q, k, v, sdpa(q, k, v, head_dim**-0.5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_prefill_attention_equals_sdpa(heads, kv_heads, head_dim, length, offset):
    q, k, v, expected = chunk(heads, kv_heads, head_dim, length, offset)
    out = torch.full(expected.shape, float("nan"))
    assert native_prefill_attention(out, q, k, v, head_dim**-0.5)
    # Float rounding only: another summation order, another exp (~1e-6 at these scales).
    assert (out - expected).abs().max() < 2e-6


@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_prefill_attention_bf16(heads, kv_heads, head_dim, length, offset):
    if not supported(bf16=True):
        pytest.skip("no AVX512_BF16 on this CPU")
    q, k, v, expected = chunk(heads, kv_heads, head_dim, length, offset)
    out = torch.full(expected.shape, float("nan"))
    assert native_prefill_attention(out, q, k, v, head_dim**-0.5, bf16=True)
    assert (out - expected).abs().max() < 0.1


def test_unsupported_head_dim_falls_back():
    q, k, v = qkv_views(8, 2, 2, 32)
    out = torch.zeros(8, 2, 32)
    assert not native_prefill_attention(out, q, k, v, 0.1)
    assert not out.any()


def test_paged_attention_prefix_and_chunk():
    """A whole prompt, then two chunks after a cached prefix (chunked prefill), in one batch
    with a decode: native prefill chunks give SDPA's result over the whole context."""
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    cache = torch.zeros(2, 32, bs, kv_heads, dim)
    q, k, v = qkv_views(120, heads, kv_heads, dim)
    # Request A: prompt of 70 tokens at once (blocks 1..5); B: 50 tokens, 30 cached already.
    blocks_a, blocks_b = [1, 2, 3, 4, 5], [6, 7, 8, 9]
    pre = build_metadata([(0, 30, blocks_b)], bs, q.device)
    paged_attention(q[70:100], k[70:100], v[70:100], cache, pre, dim**-0.5)
    meta = build_metadata([(0, 70, blocks_a), (30, 20, blocks_b)], bs, q.device)
    idx = torch.cat([torch.arange(70), torch.arange(100, 120)])
    out = paged_attention(q[idx], k[idx], v[idx], cache, meta, dim**-0.5)
    scale, tol = dim**-0.5, dict(atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(out[:70], sdpa(q[:70], k[:70], v[:70], scale), **tol)
    torch.testing.assert_close(out[70:], sdpa(q[100:], k[70:], v[70:], scale), **tol)
