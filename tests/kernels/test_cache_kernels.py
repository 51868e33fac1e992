"""The native reshape_and_cache equals the pure-torch one; a killed build never blocks the next."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.kernels.conftest import require_native
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


def test_native_kernel_matches_fallback():
    require_native(ops.has_native_kernels)  # built by `make kernels`, else here (slow)
    key, value, cache, slots = _random_case()
    expected = cache.clone()
    ops.reshape_and_cache_torch(key, value, expected, slots)
    ops.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)


def _expected(key, value, cache, slots):
    """Token by token, in Python: the contract (slot < 0 writes nothing)."""
    out, bs = cache.clone(), cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[0, slot // bs, slot % bs] = key[i]
            out[1, slot // bs, slot % bs] = value[i]
    return out


@pytest.mark.parametrize(
    "slots",
    [
        [-1, -1, -1],  # nothing to write: slot 0 gets its own contents back
        [-1, 0, -1, 5],  # padding sent to slot 0, which a real token writes
        [3, -1, 0, -1],
        [2, 7, 0],  # no padding at all
        [],  # no token
    ],
)
def test_padding_rule_is_exact(slots):
    g = torch.Generator().manual_seed(len(slots))
    key = torch.randn(len(slots), 2, 4, generator=g)
    value = torch.randn(len(slots), 2, 4, generator=g)
    cache = torch.randn(2, 3, 4, 2, 4, generator=g)  # random: an unwanted write shows
    slots = torch.tensor(slots, dtype=torch.long)
    expected = _expected(key, value, cache, slots)
    ops.reshape_and_cache_torch(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_unpadded_fast_path_equals_the_general_one():
    key, value, cache, _ = _random_case()
    slots = torch.randperm(cache.shape[1] * cache.shape[2], generator=torch.Generator())[:37]
    general = cache.clone()
    ops.reshape_and_cache_torch(key, value, general, slots)
    ops.reshape_and_cache_torch(key, value, cache, slots, padded=False)
    assert torch.equal(cache, general)


def test_no_host_sync_on_cuda_tensors():
    # Under FakeTensorMode (fake CUDA tensors on this CPU-only build) reading a device value
    # raises, as `bool(keep.all())` did here; the padding rule is device ops only.
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    with FakeTensorMode():
        dev = torch.device("cuda", 0)
        key = torch.empty(5, 2, 8, device=dev, dtype=torch.bfloat16)
        value = torch.empty(5, 2, 8, device=dev, dtype=torch.bfloat16)
        cache = torch.empty(2, 4, 16, 2, 8, device=dev, dtype=torch.bfloat16)
        slots = torch.empty(5, dtype=torch.long, device=dev)
        ops.reshape_and_cache_torch(key, value, cache, slots)
        ops.reshape_and_cache(key, value, cache, slots)  # the dispatcher takes it on CUDA
        with pytest.raises(DataDependentOutputException):
            bool((slots >= 0).all())


def _fake_load(seen: list):
    """torch's ``cpp_extension.load`` as the build sees it: records whether torch's lock
    file is there when it would take it, and writes the library the build names."""

    def load(name, build_directory, **_):
        seen.append((Path(build_directory) / "lock").exists())
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    return load


def test_a_build_killed_midway_does_not_block_the_next(tmp_path, monkeypatch):
    """A killed build leaves torch's bare lock file; the next build removes it (under our
    flock no build of ours runs) instead of waiting on it forever."""
    import torch.utils.cpp_extension

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    seen: list[bool] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_load(seen))
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "lock").touch()  # what a SIGKILLed torch build leaves
    assert ops.build() == tmp_path / "kernels" / f"{ops._jit_name()}.so"
    assert seen == [False]


def test_a_live_build_is_waited_for(tmp_path, monkeypatch):
    """While another process holds the build flock, a build waits; it goes on when the
    holder releases it (or dies: the kernel drops an flock with its process)."""
    import torch.utils.cpp_extension

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    seen: list[bool] = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_load(seen))
    (tmp_path / "kernels").mkdir()
    holder = open(tmp_path / "kernels" / "build.flock", "a")  # another open file: flocks conflict
    fcntl.flock(holder, fcntl.LOCK_EX)
    t = threading.Thread(target=ops.build)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and seen == []
    fcntl.flock(holder, fcntl.LOCK_UN)
    holder.close()
    t.join(timeout=10)
    assert not t.is_alive() and seen == [False]
