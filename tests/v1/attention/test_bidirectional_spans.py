"""Rows that attend to each other both ways (the ``bidirectional_spans`` feature: one
image's tokens in Gemma 3) in the torch backend: prefill chunks with and without cached
prefixes, beside decodes, with and without a sliding window and soft cap, against
attention written out in float64 (a query sees the keys before it and, inside a span,
every key of the span; the window is applied over both, as transformers' Gemma 3 masks);
spans per KV cache group; a span no chunk holds is refused."""

from __future__ import annotations

import math

import pytest
import torch

from vllm._custom_ops import reshape_and_cache
from vllm.v1.attention.backends import torch_sdpa
from vllm.v1.attention.backends.abstract import GroupedMetadata, attend_both_ways

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 64, 4  # head_dim 64: the native prefill kernel's


def reference(q, k, v, computed, spans, scale, window, softcap) -> torch.Tensor:
    """One sequence's new tokens over its context in float64, a query at a time; ``spans``
    in the sequence's positions."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    positions = torch.arange(k.shape[0])
    for i in range(q.shape[0]):
        pos = computed + i
        seen = positions <= pos
        for a, b in spans:
            if a <= pos < b:
                seen |= (positions >= a) & (positions < b)
        if window is not None:
            seen &= positions > pos - window
        scores = torch.einsum("hd,khd->hk", q[i].double(), k[seen]) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[seen])
    return out


def setup(layout, window=None, softcap=None, dtype=torch.float32):
    """``layout``: per sequence (cached, new, spans in its positions), decodes first. The
    step: (q, k, v of its new tokens, the cache holding the cached prefixes, the seqs, the
    spans as rows of the flat batch, the reference, the scale)."""
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = max(c + n for c, n, _ in layout) // BLOCK + 1
    cache = torch.zeros(2, 1 + blocks_per_seq * len(layout), BLOCK, KV_HEADS, DIM, dtype=dtype)
    scale = 1 / math.sqrt(DIM)
    seqs, qs, ks, vs, refs, flat_spans = [], [], [], [], [], []
    row = 0
    for i, (computed, new, spans) in enumerate(layout):
        block_ids = list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        ctx = computed + new
        q = torch.randn(new, HEADS, DIM, generator=g).to(dtype)
        k = (torch.randn(ctx, KV_HEADS, DIM, generator=g) * 2).to(dtype)
        v = torch.randn(ctx, KV_HEADS, DIM, generator=g).to(dtype)
        if computed:
            slots = torch.tensor(torch_sdpa._slots(block_ids, 0, computed, BLOCK))
            reshape_and_cache(k[:computed], v[:computed], cache, slots)
        seqs.append((computed, new, block_ids))
        qs.append(q)
        ks.append(k[computed:])
        vs.append(v[computed:])
        refs.append(reference(q, k, v, computed, spans, scale, window, softcap))
        # The step's rows of each span's positions from this step on.
        flat_spans += [(row + max(a, computed) - computed, row + b - computed) for a, b in spans]
        row += new
    step = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    return *step, cache, seqs, flat_spans, torch.cat(refs), scale


def run_batch(layout, window=None, softcap=None, dtype=torch.float32, grouped=False):
    """The torch backend's attention of the step, its spans marked. Returns (ours,
    reference)."""
    q, k, v, cache, seqs, flat_spans, ref, scale = setup(layout, window, softcap, dtype)
    meta = torch_sdpa.build_metadata(seqs, BLOCK, "cpu")
    if grouped:  # two KV cache groups, each with its own metadata of the same chunks
        meta = GroupedMetadata([meta, torch_sdpa.build_metadata(seqs, BLOCK, "cpu")], [0, 1])
        attend_both_ways(meta, flat_spans)
        meta = meta.layers[1]
    else:
        attend_both_ways(meta, flat_spans)
    out = torch_sdpa.paged_attention(
        q, k, v, cache, meta, scale, sliding_window=window, logits_soft_cap=softcap
    )
    return out, ref


LAYOUTS = {
    "prompt": [(0, 20, [(3, 11)])],
    "two images": [(0, 24, [(2, 8), (12, 20)])],
    "over a prefix": [(9, 15, [(11, 19)])],
    "hit inside the image": [(6, 12, [(3, 10)])],  # positions 3..5 cached
    "beside decodes": [(13, 1, []), (7, 1, []), (0, 18, [(4, 12)]), (5, 10, [(6, 14)])],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (None, 5.0)])
def test_spans_attend_both_ways_as_the_written_out_reference(layout, window, softcap):
    ours, ref = run_batch(LAYOUTS[layout], window, softcap)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)


def test_spans_are_not_causal_attention():
    """The same batch without its spans differs (the test above can fail)."""
    ours, ref = run_batch(LAYOUTS["prompt"])
    causal, _ = run_batch([(0, 20, [])])
    assert (ours - causal).abs().max() > 1e-2
    assert (causal[:3] - ours[:3]).abs().max() < 1e-5  # rows before the span see the same


def test_spans_reach_every_kv_cache_group():
    ours, ref = run_batch(LAYOUTS["over a prefix"], grouped=True)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)


def test_bf16_chunks_with_spans():
    ours, ref = run_batch(LAYOUTS["beside decodes"], dtype=torch.bfloat16)
    torch.testing.assert_close(ours.double(), ref, atol=5e-2, rtol=5e-2)


def test_a_span_no_prefill_chunk_holds_is_refused():
    seqs = [(5, 1, [1, 2]), (0, 8, [3, 4])]
    meta = torch_sdpa.build_metadata(seqs, BLOCK, "cpu")
    with pytest.raises(ValueError, match="rows 0:3"):
        meta.attend_both_ways([(0, 3)])  # the decode's row and the chunk's first two
    meta.attend_both_ways([(0, 1)])  # one row changes nothing
    assert meta.prefills[0].spans == []
    meta.attend_both_ways([(2, 6)])
    assert meta.prefills[0].spans == [(1, 5)]


def test_only_backends_with_the_feature_serve_a_model_that_needs_it():
    from vllm.v1.attention.backends.registry import backend_names, get_backend_class

    needs = frozenset({"bidirectional_spans", "sliding_window"})
    has = [
        n
        for n in backend_names()
        if "bidirectional_spans" in get_backend_class(n).supported_features
    ]
    assert has == ["TORCH_FLASH_ATTN", "TORCH_SDPA"]
    reasons = get_backend_class("FLASH_ATTN").unsupported_features(needs)
    assert "bidirectional spans attention is not supported by FLASH_ATTN" in reasons


@pytest.mark.parametrize("layout", ["beside decodes", "hit inside the image", "two images"])
@pytest.mark.parametrize("mode", ["varlen", "triton"])
@pytest.mark.parametrize("window", [None, 6])
def test_torch_flash_attends_the_spans_again(monkeypatch, layout, mode, window):
    """TORCH_FLASH_ATTN on the CPU with its kernels emulated (tests/v1/attention/
    test_flash_features.py's way): its causal kernels, then the spans placed by the step's
    sequences (``BothWays.attend_both_ways``) attended again from the cache, give the
    written-out reference, with either decode kernel; without the spans they do not."""
    from tests.v1.attention.test_torch_flash import install, ref_varlen_attn
    from tests.v1.attention.test_triton_decode import emulated_kernel
    from vllm.v1.attention.backends import triton_decode
    from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend

    install(monkeypatch, ref_varlen_attn)
    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated_kernel([]))
    q, k, v, cache, seqs, flat_spans, ref, scale = setup(LAYOUTS[layout], window)
    backend = TorchFlashAttentionBackend(HEADS, KV_HEADS, DIM, torch.float32, "cpu", BLOCK)
    backend.decode_kernel = mode
    outs = []
    for spans in (flat_spans, []):
        meta = backend.build_metadata(seqs)
        attend_both_ways(meta, spans)
        outs.append(backend.forward(q, k, v, cache, meta, scale, sliding_window=window))
    assert [(c.start, c.num_tokens) for c in meta.both_ways] == []
    torch.testing.assert_close(outs[0].double(), ref, atol=2e-5, rtol=2e-5)
    assert (outs[1].double() - ref).abs().max() > 1e-2
    if len(seqs) > 1:
        with pytest.raises(ValueError, match="rows 1:4 attend both ways but no sequence"):
            meta.attend_both_ways([(1, 4)])  # a decode's row and a chunk's
