"""The latent KV cache (MLA: keys only, a value is its key's first ``value_size`` dims;
``backends/abstract.py``): the K-only write, TORCH_SDPA's paths over it against attention
written out in float64 (decodes, prompts, chunks over a cached prefix, an FP8 cache), and
the selector's rule for a backend that serves latent caches only (``required_features``).
"""

from __future__ import annotations

import logging

import pytest
import torch

from vllm._custom_ops import reshape_and_cache, reshape_and_cache_torch
from vllm.v1.attention.backends.abstract import kv_cache_shape
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend
from vllm.v1.attention.kv_cache_dtype import as_stored
from vllm.v1.attention.selector import select_attention_backend

HEADS, LATENT, ROPE, BLOCK = 4, 24, 8, 4
DIM = LATENT + ROPE


def test_kv_cache_shape_holds_one_half_for_a_latent_cache():
    assert kv_cache_shape(9, 16, 1, 576, latent=True) == (1, 9, 16, 1, 576)
    assert kv_cache_shape(9, 16, 2, 64, latent=False) == (2, 9, 16, 2, 64)
    backend = TorchSDPABackend(HEADS, 1, DIM, torch.float32, "cpu", BLOCK, value_size=LATENT)
    assert backend.latent and backend.kv_cache_shape(5) == (1, 5, BLOCK, 1, DIM)
    assert not TorchSDPABackend(HEADS, 1, DIM, torch.float32, "cpu", BLOCK).latent
    with pytest.raises(ValueError, match="value_size"):
        TorchSDPABackend(HEADS, 1, DIM, torch.float32, "cpu", BLOCK, value_size=DIM + 1)


@pytest.mark.parametrize("write", [reshape_and_cache, reshape_and_cache_torch])
def test_keys_only_write(write):
    cache = torch.full((1, 3, BLOCK, 1, DIM), 5.0)
    key = torch.randn(3, 1, DIM)
    write(key, None, cache, torch.tensor([6, -1, 1]))  # a padding token: skipped
    flat = cache[0].view(-1, 1, DIM)
    assert torch.equal(flat[6], key[0]) and torch.equal(flat[1], key[2])
    untouched = [s for s in range(12) if s not in (1, 6)]
    assert (flat[untouched] == 5.0).all()
    with pytest.raises(ValueError, match="K and V"):  # keys alone into a K/V cache
        reshape_and_cache_torch(key, None, torch.zeros(2, 3, BLOCK, 1, DIM), torch.arange(3))


def reference(q, keys, scale, start):
    """float64 causal attention of queries at positions ``start..`` over ``keys`` (one
    latent head), values the keys' first LATENT dims: (tokens, heads, LATENT)."""
    q, keys = q.double(), keys.double()[:, 0]
    out = []
    for i in range(q.shape[0]):
        seen = keys[: start + i + 1]
        probs = (q[i] @ seen.T * scale).softmax(-1)  # (heads, len)
        out.append(probs @ seen[:, :LATENT])
    return torch.stack(out)


def run_steps(backend, cache_dtype, steps, seed=0):
    """Drive ``backend`` through ``steps`` (each a list of (seq, num_new)) over three
    sequences with scattered blocks; returns the worst error against float64."""
    gen = torch.Generator().manual_seed(seed)
    blocks = {0: [3, 7, 1, 12], 1: [2, 9, 4, 5], 2: [11, 6, 8, 10]}
    cache = torch.zeros(backend.kv_cache_shape(13), dtype=cache_dtype)
    keys = {s: torch.zeros(0, 1, DIM) for s in blocks}  # each sequence's keys as stored
    computed = dict.fromkeys(blocks, 0)
    scale, worst = DIM**-0.5, 0.0
    for step in steps:
        seqs = [(computed[s], n, blocks[s]) for s, n in step]
        total = sum(n for _, n in step)
        q, k = (
            torch.randn(total, HEADS, DIM, generator=gen),
            torch.randn(total, 1, DIM, generator=gen),
        )
        out = backend.forward(q, k, None, cache, backend.build_metadata(seqs), scale)
        assert out.shape == (total, HEADS, LATENT)
        row = 0
        for s, n in step:
            keys[s] = torch.cat([keys[s], as_stored(k[row : row + n], cache_dtype)])
            ref = reference(q[row : row + n], keys[s], scale, computed[s])
            worst = max(worst, float((out[row : row + n].double() - ref).abs().max()))
            computed[s] += n
            row += n
    return worst


# Prompts (one over a prefix from an earlier chunk), then decodes ahead of a chunk.
STEPS = [[(0, 5), (1, 3)], [(0, 1), (1, 1), (2, 6)], [(0, 1), (2, 4)], [(0, 1), (1, 1), (2, 1)]]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_torch_sdpa_over_a_latent_cache_equals_float64(cache_dtype):
    backend = TorchSDPABackend(HEADS, 1, DIM, torch.float32, "cpu", BLOCK, value_size=LATENT)
    assert run_steps(backend, cache_dtype, STEPS) < 1e-5


def test_the_check_catches_values_from_other_dims(monkeypatch):
    # Values read from the cached rows' last LATENT dims (not their first) fail the check.
    from vllm.v1.attention.backends import torch_sdpa

    def last_dims(kv_cache, value_size):
        flat_k = kv_cache[0].view(-1, kv_cache.shape[3], kv_cache.shape[4])
        return flat_k, flat_k[..., -value_size:]

    monkeypatch.setattr(torch_sdpa, "cache_views", last_dims)
    backend = TorchSDPABackend(HEADS, 1, DIM, torch.float32, "cpu", BLOCK, value_size=LATENT)
    assert run_steps(backend, torch.float32, STEPS) > 1e-3


def test_a_latent_only_backend_is_never_offered_to_other_models(caplog):
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING):
        plain = select_attention_backend(cpu, torch.float32, 16, 64)
        latent = select_attention_backend(cpu, torch.float32, 16, 576, features={"latent_kv"})
    assert plain.name == latent.name == "TORCH_SDPA"
    assert "TRITON_MLA" not in caplog.text
    with pytest.raises(ValueError, match="latent kv attention is not supported"):
        select_attention_backend(
            cpu, torch.float32, 16, 64, forced="TORCH_FLASH_ATTN", features={"latent_kv"}
        )


def test_latent_prefill_chunks_take_the_native_kernel_through_whole_rows(monkeypatch):
    # The native prefill kernel takes values as wide as keys: a latent chunk goes in with
    # its whole rows as values (a prefix gathered once), and the first LATENT dims of the
    # output are kept; still float64's (run_steps), with every chunk on the kernel.
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import torch_sdpa

    if ops._op("prefill_attention") is None:
        pytest.skip("the native prefill kernel is not built")
    calls = []
    native = torch_sdpa.native_prefill_attention

    def counting(out, query, keys, values, scale, bf16=False):
        ok = native(out, query, keys, values, scale, bf16)
        calls.append((ok, keys.data_ptr() == values.data_ptr(), values.shape[2]))
        return ok

    monkeypatch.setattr(torch_sdpa, "native_prefill_attention", counting)
    backend = TorchSDPABackend(HEADS, 1, DIM, torch.float32, "cpu", BLOCK, value_size=LATENT)
    assert run_steps(backend, torch.float32, STEPS) < 1e-5
    # DIM 32 is no multiple of 64: the kernel declines and SDPA takes over.
    assert calls and all(same and width == DIM and not ok for ok, same, width in calls)
    calls.clear()
    wide = TorchSDPABackend(2, 1, 128, torch.float32, "cpu", BLOCK, value_size=96)
    cache = torch.zeros(wide.kv_cache_shape(8))
    q, k = torch.randn(9, 2, 128), torch.randn(9, 1, 128)
    for computed, n in ((0, 5), (5, 4)):  # a prompt, then a chunk over its prefix
        meta = wide.build_metadata([(computed, n, [3, 1, 6])])
        out = wide.forward(q[computed : computed + n], k[computed : computed + n], None,
                           cache, meta, 0.1)  # fmt: skip
        keys = k[: computed + n, 0].double()
        pos = torch.arange(computed, computed + n)
        scores = torch.einsum("qhd,kd->qhk", q[computed : computed + n].double(), keys) * 0.1
        scores = scores.masked_fill(torch.arange(computed + n) > pos[:, None, None], -torch.inf)
        ref = scores.softmax(-1) @ keys[:, :96]
        assert (out.double() - ref).abs().max() < 1e-5
    assert calls == [(True, True, 128)] * 2


def test_latent_decodes_take_the_native_kernel_through_whole_rows(monkeypatch):
    # The native decode kernel reads a one-plane cache's keys as its values: decode rows
    # (every step after the first here) go to it, and the output's first LATENT dims are
    # float64's (run_steps) like the rest.
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import torch_sdpa

    if not ops.has_paged_decode_attention():
        pytest.skip("the native decode kernel is not built")
    calls = []
    native = ops.paged_decode_attention

    def counting(out, query, kv_cache, block_table, seq_lens, scale):
        calls.append((kv_cache.shape[0], out.shape[-1]))
        return native(out, query, kv_cache, block_table, seq_lens, scale)

    monkeypatch.setattr(torch_sdpa.ops, "paged_decode_attention", counting)
    backend = TorchSDPABackend(HEADS, 1, DIM, torch.float32, "cpu", BLOCK, value_size=LATENT)
    assert run_steps(backend, torch.float32, STEPS) < 1e-5
    assert calls == [(1, DIM)] * 3  # the three steps with decode rows, whole rows out
