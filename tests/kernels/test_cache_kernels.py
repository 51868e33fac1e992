"""The native reshape_and_cache equals the pure-torch one (the native build is slow: marked)."""

from __future__ import annotations

import shutil

import pytest
import torch

from vllm import _custom_ops as ops


def _random_case(num_tokens: int = 37, blocks: int = 12, bs: int = 4, heads: int = 3, d: int = 8):
    g = torch.Generator().manual_seed(0)
    key = torch.randn(num_tokens, heads, d, generator=g)
    value = torch.randn(num_tokens, heads, d, generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:num_tokens]
    slots[::7] = -1  # padding tokens are skipped
    return key, value, torch.zeros(2, blocks, bs, heads, d), slots


def test_torch_fallback_writes_each_token_to_its_slot():
    key, value, cache, slots = _random_case()
    ops.reshape_and_cache_torch(key, value, cache, slots)
    bs = cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(cache[0, slot // bs, slot % bs], key[i])
        assert torch.equal(cache[1, slot // bs, slot % bs], value[i])
    # Padding tokens wrote nothing: exactly the non-padding slots are non-zero.
    written = cache[0].reshape(-1, cache.shape[3] * cache.shape[4]).abs().sum(-1) > 0
    assert int(written.sum()) == int((slots >= 0).sum())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_native_kernel_matches_fallback():
    ops.build()
    assert ops.has_native_kernels()
    key, value, cache, slots = _random_case()
    expected = cache.clone()
    ops.reshape_and_cache_torch(key, value, expected, slots)
    ops.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)
