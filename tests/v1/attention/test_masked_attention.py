"""Sliding-window and soft-capped attention in the torch backend (``torch_sdpa``): a batch of
decodes and prefill chunks, with and without cached prefixes, against attention written out
in float64 position by position; the selector keeps a model that needs them off backends that
lack them."""

from __future__ import annotations

import math

import pytest
import torch

from vllm._custom_ops import reshape_and_cache
from vllm.v1.attention.backends import torch_sdpa
from vllm.v1.attention.backends.abstract import AttentionBackend
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

HEADS, KV_HEADS, DIM, BLOCK = 4, 2, 16, 4


def reference(q_seq, k_seq, v_seq, computed, scale, window, softcap, sinks=None) -> torch.Tensor:
    """One sequence's new tokens over its whole context, in float64, a query at a time."""
    out = torch.empty(q_seq.shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    k = k_seq.double().repeat_interleave(group, 1)  # (ctx, heads, dim)
    v = v_seq.double().repeat_interleave(group, 1)
    for i in range(q_seq.shape[0]):
        pos = computed + i
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,khd->hk", q_seq[i].double(), k[lo : pos + 1]) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is None:
            probs = scores.softmax(-1)
        else:  # exp(s) / (sum exp(s) + exp(sink)), per head
            e = torch.exp(scores - scores.max(-1, keepdim=True).values)
            sink = torch.exp(sinks.double() - scores.max(-1).values)
            probs = e / (e.sum(-1) + sink).unsqueeze(-1)
        out[i] = torch.einsum("hk,khd->hd", probs, v[lo : pos + 1])
    return out


def run_batch(layout, window, softcap, seed=0, sinks=None):
    """``layout``: per sequence (cached tokens, new tokens), decodes first. Returns (ours,
    reference) over the flat batch of new tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = max(c + n for c, n in layout) // BLOCK + 1
    cache = torch.zeros(2, 1 + blocks_per_seq * len(layout), BLOCK, KV_HEADS, DIM)
    scale = 1 / math.sqrt(DIM)
    seqs, qs, ks, vs, refs = [], [], [], [], []
    for i, (computed, new) in enumerate(layout):
        block_ids = list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))
        ctx = computed + new
        q = torch.randn(new, HEADS, DIM, generator=g)
        k = torch.randn(ctx, KV_HEADS, DIM, generator=g) * 2  # scores large enough to cap
        v = torch.randn(ctx, KV_HEADS, DIM, generator=g)
        if computed:  # the cached prefix, written by earlier steps
            slots = torch.tensor(torch_sdpa._slots(block_ids, 0, computed, BLOCK))
            reshape_and_cache(k[:computed], v[:computed], cache, slots)
        seqs.append((computed, new, block_ids))
        qs.append(q)
        ks.append(k[computed:])
        vs.append(v[computed:])
        refs.append(reference(q, k, v, computed, scale, window, softcap, sinks))
    meta = torch_sdpa.build_metadata(seqs, BLOCK, "cpu")
    out = torch_sdpa.paged_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, scale,
        sliding_window=window, logits_soft_cap=softcap, sinks=sinks,
    )  # fmt: skip
    return out, torch.cat(refs)


LAYOUTS = [
    [(30, 1), (5, 1), (2, 1), (0, 23)],  # decodes longer and shorter than the window, a prompt
    [(17, 9), (0, 40)],  # a chunk over a cached prefix that crosses the window, a prompt
    [(40, 1)],  # a pure decode step
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window, softcap", [(8, None), (None, 5.0), (8, 5.0), (1, None)])
def test_masked_attention_equals_the_written_out_reference(layout, window, softcap):
    ours, ref = run_batch(layout, window, softcap)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("window", [None, 8])
def test_attention_sinks_equal_the_written_out_reference(layout, window):
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])  # per head
    ours, ref = run_batch(layout, window, None, sinks=sinks)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)
    plain, _ = run_batch(layout, window, None)
    assert (ours - plain).abs().max() > 1e-2  # the sinks take weight off every row


def test_the_reference_tells_a_window_from_the_whole_context():
    """The window matters for these layouts: without it the outputs differ."""
    ours, ref = run_batch(LAYOUTS[0], None, None)
    _, windowed = run_batch(LAYOUTS[0], 8, None)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)
    assert (windowed - ref).abs().max() > 1e-2


def test_a_window_reuses_its_decode_slots_across_layers():
    meta = torch_sdpa.build_metadata([(30, 1, list(range(1, 10))), (3, 1, [10])], BLOCK, "cpu")
    slots, mask = meta.decode_window(8)
    assert slots.shape == (2, 8) and mask.shape == (2, 1, 1, 8)
    assert meta.decode_window(8)[0] is slots
    # Row 0 sees positions 23..30; row 1 its 4 positions, the rest masked.
    assert slots[0].tolist() == torch_sdpa._slots(range(1, 10), 23, 31, BLOCK)
    assert mask[1].flatten().tolist() == [True] * 4 + [False] * 4


def test_the_eager_path_bounds_its_scores_by_query_rows(monkeypatch):
    monkeypatch.setattr(torch_sdpa, "_EAGER_QUERY_ROWS", 7)
    ours, ref = run_batch([(0, 30)], 6, 5.0)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=2e-5)


class _Plain(AttentionBackend):
    name = "PLAIN_TEST"
    priority = 100

    def build_metadata(self, seqs):
        raise NotImplementedError

    def forward(self, q, k, v, kv_cache, meta, scale):
        raise NotImplementedError


def test_selector_passes_over_a_backend_without_the_models_features(monkeypatch):
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends import registry

    monkeypatch.setitem(registry._REGISTRY, "PLAIN_TEST", _Plain)
    cpu = torch.device("cpu")
    assert selector.select_attention_backend(cpu, torch.float32, 16, 64) is _Plain
    picked = selector.select_attention_backend(
        cpu, torch.float32, 16, 64, features=frozenset({"sliding_window"})
    )
    assert picked is TorchSDPABackend
    with pytest.raises(ValueError, match="logits soft cap attention is not supported by PLAIN"):
        selector.select_attention_backend(
            cpu, torch.float32, 16, 64, "PLAIN_TEST", frozenset({"logits_soft_cap"})
        )
    assert TorchSDPABackend.unsupported_features(frozenset({"sliding_window"})) == []


def test_a_prefill_chunk_builds_each_windows_mask_once():
    meta = torch_sdpa.build_metadata([(17, 9, list(range(1, 8)))], BLOCK, "cpu")
    chunk = meta.prefills[0]
    first, mask = chunk.window_mask(8, torch.device("cpu"))
    assert chunk.window_mask(8, torch.device("cpu"))[1] is mask  # every layer's
    # Positions 17..25 with a window of 8 reach back to position 10; each sees 8 keys.
    assert first == 10 and mask.shape == (9, 16)
    assert mask.sum(1).tolist() == [8] * 9
    whole_first, whole = chunk.window_mask(None, torch.device("cpu"))
    assert (
        whole_first == 0 and whole.shape == (9, 26) and whole.sum(1).tolist() == list(range(18, 27))
    )
