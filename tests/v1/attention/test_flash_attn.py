"""The flash-attn backend's metadata and call arguments, checked on CPU.

flash-attn cannot run here, so ``ref_varlen_attention`` emulates the documented
semantics of ``flash_attn_varlen_func`` (varlen packing, optional ``block_table`` over
``(num_blocks, page_size, kv_heads, head_dim)`` pages, GQA, causal mask aligned to the
bottom-right corner) in plain torch, and is installed as a fake ``flash_attn`` module.
The backend's output must then equal the torch backend's on the same random batch.
"""

from __future__ import annotations

import math
import random
import sys
import types

import pytest
import torch

from vllm.v1.attention.backends import flash_attn, torch_sdpa


def ref_varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    block_table=None,
):
    """Pure-torch ``flash_attn_varlen_func`` (the documented forward semantics)."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    heads, head_dim = q.shape[1], q.shape[2]
    if block_table is not None:
        assert block_table.dtype == torch.int32 and k.dim() == 4  # pages
    else:
        assert k.dim() == 3 and k.shape[0] == int(cu_seqlens_k[-1])  # packed keys
    group = heads // k.shape[-2]
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(head_dim)
    out = torch.zeros_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        len_k = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        assert qe - qs <= max_seqlen_q and len_k <= max_seqlen_k
        if block_table is not None:
            pages = block_table[i, : -(-len_k // k.shape[1])].long()
            keys = k[pages].flatten(0, 1)[:len_k]
            values = v[pages].flatten(0, 1)[:len_k]
        else:
            ks = int(cu_seqlens_k[i])
            keys, values = k[ks : ks + len_k], v[ks : ks + len_k]
        keys = keys.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[qs:qe], keys) * scale
        if causal:  # bottom-right: query row j sees keys [0, len_k - len_q + j]
            rows = torch.arange(qe - qs)[:, None] + (len_k - (qe - qs))
            scores = scores.masked_fill(torch.arange(len_k)[None, :] > rows, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


@pytest.fixture
def fake_flash_attn(monkeypatch):
    calls = []

    def varlen(*args, **kwargs):
        calls.append(kwargs)
        return ref_varlen_attention(*args, **kwargs)

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


def test_metadata_is_paged_only_for_pages_flash_attn_accepts():
    # The layout itself is tests/v1/attention/test_varlen_metadata.py's.
    seqs = [(5, 1, [3, 7]), (0, 6, [2, 9, 11])]
    meta = flash_attn.build_flash_metadata(seqs, 4, torch.device("cpu"))
    assert not meta.paged and meta.gather_slots.tolist() == [12, 13, 14, 15, 28, 29] + [
        8,
        9,
        10,
        11,
        36,
        37,
    ]
    paged = flash_attn.build_flash_metadata([(300, 1, [5, 2])], 256, torch.device("cpu"))
    assert paged.paged and paged.gather_slots is None
    assert paged.block_table.tolist() == [[5, 2]]


# (computed, new): two decodes, a whole prompt, a chunk over a cached prefix, and one
# context longer than 256 so the paged case spans two pages.
BATCH = [(9, 1), (0, 7), (3, 1), (6, 5), (250, 10)]


def _make_batch(block_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-(c + n) // block_size) for c, n in BATCH]
    num_blocks = sum(needs) + 3
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)  # scattered, non-contiguous blocks
    seqs, it = [], iter(ids)
    for (c, n), need in zip(BATCH, needs, strict=True):
        seqs.append((c, n, [next(it) for _ in range(need)]))
    heads, kv_heads, dim = 6, 2, 8
    tokens = sum(n for _, n in BATCH)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    # Random "cached prefix" contents everywhere; block 0 (null) too, to catch reads of it.
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    return seqs, q, k, v, cache


@pytest.mark.parametrize("block_size", [4, 16, 256])
def test_flash_backend_matches_torch_backend(fake_flash_attn, block_size):
    seqs, q, k, v, cache = _make_batch(block_size, seed=block_size)
    scale = 0.3
    # The flash backend takes the batch as scheduled (a prefill between decodes); the
    # torch backend needs decodes first, so its rows are a permutation of ours.
    starts, pos = [], 0
    for _, n, _ in seqs:
        starts.append(pos)
        pos += n
    decodes_first = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0]))
    perm = torch.cat([torch.arange(starts[i], starts[i] + seqs[i][1]) for i in decodes_first])

    flash_cache = cache.clone()
    fmeta = flash_attn.build_flash_metadata(seqs, block_size, torch.device("cpu"))
    out = flash_attn.flash_paged_attention(q, k, v, flash_cache, fmeta, scale)

    torch_cache = cache.clone()
    tmeta = torch_sdpa.build_metadata([seqs[i] for i in decodes_first], block_size, "cpu")
    expected = torch_sdpa.paged_attention(q[perm], k[perm], v[perm], torch_cache, tmeta, scale)

    assert len(fake_flash_attn) == 1
    call = fake_flash_attn[0]
    assert call["causal"] is True and call["softmax_scale"] == scale
    assert (call["block_table"] is not None) == (block_size % 256 == 0)
    torch.testing.assert_close(flash_cache, torch_cache, rtol=0, atol=0)
    torch.testing.assert_close(out[perm], expected, rtol=1e-5, atol=1e-5)


def test_reference_detects_a_wrong_causal_alignment():
    # Guards the emulation itself: top-left alignment would differ for a chunk with prefix.
    seqs, q, k, v, cache = _make_batch(16, seed=1)
    meta = flash_attn.build_flash_metadata(seqs, 16, torch.device("cpu"))
    kv = cache.view(2, -1, 2, 8)
    keys, values = kv[0][meta.gather_slots], kv[1][meta.gather_slots]
    args = (q, keys, values, meta.cu_seq_q, meta.cu_seq_k, 10, 260)
    causal = ref_varlen_attention(*args, causal=True)
    full = ref_varlen_attention(*args, causal=False)
    # Decodes (one query row, every key visible) agree; prefill rows do not.
    assert torch.equal(causal[:1], full[:1])
    assert not torch.allclose(causal[1:8], full[1:8])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block_size", [16, 256])
def test_real_flash_attn_matches_torch_backend_on_gpu(block_size):
    pytest.importorskip("flash_attn")
    seqs, q, k, v, cache = _make_batch(block_size, seed=7)
    dev, dt = torch.device("cuda"), torch.bfloat16
    q, k, v, cache = (t.to(dev, dt) for t in (q, k, v, cache))
    decodes_first = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0]))
    starts = [sum(n for _, n, _ in seqs[:i]) for i in range(len(seqs))]
    perm = torch.cat([torch.arange(starts[i], starts[i] + seqs[i][1]) for i in decodes_first]).to(
        dev
    )
    fmeta = flash_attn.build_flash_metadata(seqs, block_size, dev)
    out = flash_attn.flash_paged_attention(q, k, v, cache.clone(), fmeta, 0.3)
    tmeta = torch_sdpa.build_metadata([seqs[i] for i in decodes_first], block_size, dev)
    expected = torch_sdpa.paged_attention(q[perm], k[perm], v[perm], cache.clone(), tmeta, 0.3)
    torch.testing.assert_close(out[perm], expected, rtol=2e-2, atol=2e-2)
