"""The per-layer native kernels equal their pure-torch fallbacks: the rotation and the KV
writes bit for bit (strided views of a fused qkv output included), the norm, SiLU and the
paged decode attention up to float rounding. The native build is slow: marked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.conftest import require_native
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.torch_sdpa import _decode_attention, build_metadata

pytestmark = pytest.mark.slow
G = torch.Generator().manual_seed(0)


@pytest.fixture(scope="module", autouse=True)
def native():
    require_native(ops.has_all_native_kernels)


def qkv_views(tokens: int, heads: int, kv_heads: int, head_dim: int):
    """q, k, v: column views of one fused (tokens, (heads + 2 kv_heads) * head_dim) output."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=G)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return qkv, q, k, v


@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_fused_add_rms_norm(tokens):
    x, res, w = torch.randn(tokens, 576, generator=G), torch.randn(tokens, 576), torch.rand(576)
    x_ref, res_ref = x.clone(), res.clone()
    ops.fused_add_rms_norm_torch(x_ref, res_ref, w, 1e-5)
    ops.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, res_ref)  # the residual sum is one rounding either way
    assert torch.allclose(x, x_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 5, 130])
def test_rotary_embedding_is_bit_identical_on_strided_views(tokens):
    from vllm.model_executor.models.llama import RotaryEmbedding

    cache = RotaryEmbedding(
        64, 8192, {"rope_type": "default", "rope_theta": 100000.0}
    ).cos_sin_cache
    positions = torch.randint(0, 8192, (tokens,), generator=G)
    qkv, q, k, _ = qkv_views(tokens, 9, 3, 64)
    expected = qkv.clone()
    eq, ek, _ = expected.split([576, 192, 192], dim=-1)
    ops.rotary_embedding_torch(positions, eq, ek, 64, cache)
    ops.rotary_embedding(positions, q, k, 64, cache)
    assert torch.equal(qkv, expected)  # v untouched, q and k rotated identically


@pytest.mark.parametrize("tokens", [1, 40])
def test_silu_and_mul(tokens):
    x = torch.randn(tokens, 2 * 1536, generator=G) * 4
    expected = F.silu(x[:, :1536]) * x[:, 1536:]
    assert torch.allclose(ops.silu_and_mul(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens,d", [(1, 1536), (40, 1536), (3, 13)])
def test_silu_and_mul_bf16_rounds_the_fp32_result_once(tokens, d):
    # The gguf path's bf16 prefill hands the bf16 GEMM output to silu_and_mul: the result
    # must be the fp32 kernel's on the same inputs, rounded to bf16 (to nearest even).
    x = (torch.randn(tokens, 2 * d, generator=G) * 4).bfloat16()
    got = ops.silu_and_mul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, d)
    expected = ops.silu_and_mul(x.float()).bfloat16()
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(RuntimeError, match="one dtype"):
        torch.ops.vllm_continuum_C.silu_and_mul(torch.empty(tokens, d), x)


def test_reshape_and_cache_reads_strided_views():
    _, _, k, v = qkv_views(6, 9, 3, 64)
    slots = torch.tensor([5, 0, 17, 3, 30, 9])
    cache, expected = torch.zeros(2, 4, 8, 3, 64), torch.zeros(2, 4, 8, 3, 64)
    ops.reshape_and_cache_torch(k.view(6, 3, 64), v.view(6, 3, 64), expected, slots)
    ops.reshape_and_cache(k.view(6, 3, 64), v.view(6, 3, 64), cache, slots)
    assert torch.equal(cache, expected)


# (heads, kv_heads, head_dim, block_size, context lengths >= 2: each a decode): the model's
# GQA shape with lengths around the 8-position score groups and the block size; no GQA; a
# head size that is not a multiple of 8 (the scalar path); 10 query heads per KV head
# (scalar path).
ATTENTION_CASES = [
    (9, 3, 64, 16, [2, 7, 8, 9, 16, 17, 100, 300]),
    (4, 4, 32, 4, [2, 5, 13]),
    (6, 2, 12, 8, [3, 20]),
    (10, 1, 16, 16, [33]),
    # Contexts of several 256-position chunks, merged (one ending at a chunk's edge, one a
    # position past it), and chunks that start inside a block (12 does not divide 256).
    (9, 3, 64, 16, [1000, 512, 513, 5]),
    (6, 2, 16, 12, [600, 257]),
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,lens", ATTENTION_CASES)
def test_paged_decode_attention_matches_gathered_sdpa(heads, kv_heads, head_dim, block_size, lens):
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=G)
    # Each sequence gets shuffled blocks (a paged cache is not contiguous), block 0 unused.
    free = (torch.randperm(num_blocks - 1, generator=G) + 1).tolist()
    seqs = []
    for n in lens:
        need = -(-n // block_size)
        seqs.append((n - 1, 1, [free.pop() for _ in range(need)]))
    meta = build_metadata(seqs, block_size, torch.device("cpu"))
    _, q, _, _ = qkv_views(len(lens), heads, kv_heads, head_dim)
    q = q.view(len(lens), heads, head_dim)  # strided rows, as in the model
    scale = head_dim**-0.5
    flat = cache.view(2, -1, kv_heads, head_dim)
    expected = _decode_attention(q, flat[0], flat[1], meta, scale)
    out = torch.full_like(expected, float("nan"))
    ops.paged_decode_attention(out, q, cache, meta.decode_block_table, meta.decode_seq_lens, scale)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_paged_decode_attention_rejects_a_length_past_its_blocks():
    cache = torch.zeros(2, 4, 4, 1, 8)
    q, out = torch.zeros(1, 1, 8), torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="seq_lens"):
        ops.paged_decode_attention(out, q, cache, torch.tensor([[1, 2]]), torch.tensor([9]), 1.0)
