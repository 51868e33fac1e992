"""The native backend's copies: runs, order (saves before loads), real copies."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.core.sched.output import KVOffloadTransfers
from vllm.v1.kv_offload.registry import get_offloading_backend_class
from vllm.v1.kv_offload.worker import CPUOffloadingHandler, copy_runs


def test_copy_runs_merge_blocks_consecutive_on_both_sides():
    assert copy_runs([(3, 0), (4, 1), (5, 2), (9, 3), (2, 4)]) == [(3, 0, 3), (9, 3, 1), (2, 4, 1)]
    assert copy_runs([]) == []


def test_saves_run_before_loads_and_copies_do_not_alias():
    # 2 layers of [2, 6 blocks, 4 tokens, 1 head, 2 dims]; block i filled with i.
    caches = [torch.arange(6.0).view(1, 6, 1, 1, 1).expand(2, 6, 4, 1, 2).clone() for _ in "ab"]
    handler = get_offloading_backend_class("native")(caches, 3)
    assert isinstance(handler, CPUOffloadingHandler)
    assert handler.block_bytes == 2 * 2 * 4 * 1 * 2 * 4  # layers * K/V * slots * dims * fp32
    # Save blocks 4, 5 to tier 0, 1; in the same step load tier 0 into block 4 (the block
    # just saved: a save reads it first) and tier 1 into block 2.
    handler.transfer(KVOffloadTransfers(saves=[(4, 0), (5, 1)], loads=[(0, 4), (1, 2)]))
    for layer, tier in zip(caches, handler.cpu_caches, strict=True):
        assert torch.all(tier[:, 0] == 4) and torch.all(tier[:, 1] == 5)
        assert torch.all(layer[:, 4] == 4) and torch.all(layer[:, 2] == 5)
    caches[0][:, 2] = -1  # the tier keeps its own copy
    assert torch.all(handler.cpu_caches[0][:, 1] == 5)


def _random_caches(num_layers=3, num_blocks=40, seed=0, dtype=torch.float32, halves=2):
    """``halves`` 2: K and V; 1: a latent cache (MLA: keys only)."""
    g = torch.Generator().manual_seed(seed)
    shape = (halves, num_blocks, 4, 2, 3)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(num_layers)]


def test_host_runs_index_each_run_of_consecutive_ids():
    from vllm.v1.kv_offload.worker import host_runs

    assert host_runs([3, 4, 5, 9, 2, 3]) == [(3, 0, 3), (9, 3, 1), (2, 4, 2)]
    assert host_runs([]) == []


@pytest.mark.parametrize("halves", [2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_staged_copies_equal_per_run_copies_for_scattered_plans(monkeypatch, dtype, halves):
    """Device blocks in shuffled order, tier blocks in runs: the staged path (forced on
    CPU; on CUDA it is the default) leaves the cache and the tier bitwise as the per-run
    copies do, across several staging chunks, for saves and loads in one plan; an FP8
    cache (--kv-cache-dtype fp8) too, copied as bytes, and a latent cache of one half."""
    import vllm.v1.kv_offload.worker as worker

    monkeypatch.setattr(worker, "STAGE_BLOCKS", 5)  # 12 and 16 pairs: chunks of 5
    g = torch.Generator().manual_seed(1)
    device_blocks = torch.randperm(40, generator=g).tolist()
    saves = list(zip(device_blocks[:12], [20 + i for i in range(12)], strict=True))
    host = [2 + i for i in range(8)] + [30 + i for i in range(8)]  # two runs
    loads = list(zip(host, device_blocks[12:28], strict=True))
    results = []
    for staged in (False, True):
        caches = _random_caches(dtype=dtype, halves=halves)
        handler = CPUOffloadingHandler(caches, 40, staged=staged)
        assert handler.block_bytes == 3 * halves * 4 * 2 * 3 * caches[0].element_size()
        for tier in handler.cpu_caches:
            assert tier.dtype == dtype and tier.shape[0] == halves
            tier.copy_(torch.randn(tier.shape, generator=torch.Generator().manual_seed(2)))
        calls = []
        monkeypatch.setattr(handler, "_staged_copy", _spy(handler._staged_copy, calls))
        handler.transfer(KVOffloadTransfers(saves=saves, loads=loads))
        assert len(calls) == (2 if staged else 0)  # saves and loads are both scattered
        results.append((caches, handler.cpu_caches))
    (plain_cache, plain_tier), (staged_cache, staged_tier) = results
    for a, b in zip(plain_cache + plain_tier, staged_cache + staged_tier, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # The loads did land: each loaded device block now holds its tier block's bytes.
    for cache, tier in zip(staged_cache, staged_tier, strict=True):
        for h, d in loads:
            assert torch.equal(cache[:, d].view(torch.uint8), tier[:, h].view(torch.uint8))


class AdversarialStreams:
    """Stand-in CUDA streams on the CPU: each stream's work is queued, and ``drain`` runs
    one stream as far as its waits allow before the other, bound by the events alone. A
    missing wait then lets a buffer be refilled before it was read, or read before it was
    filled, and the copies come out wrong."""

    def __init__(self) -> None:
        self.queues: dict[str, list[tuple[str, object]]] = {}

    def run(self, stream, fn) -> None:
        self.queues.setdefault(stream, []).append(("run", fn))

    def record(self, stream):
        event = {"done": False}
        self.queues.setdefault(stream, []).append(("record", event))
        return event

    def wait(self, stream, event) -> None:
        if event is not None:
            self.queues.setdefault(stream, []).append(("wait", event))

    def drain(self, first: str) -> None:
        order = sorted(self.queues, key=lambda name: name != first)
        while any(self.queues.values()):
            progressed = False
            for name in order:
                queue = self.queues[name]
                while queue and not (queue[0][0] == "wait" and not queue[0][1]["done"]):
                    kind, item = queue.pop(0)
                    if kind == "run":
                        item()
                    elif kind == "record":
                        item["done"] = True
                    progressed = True
                if progressed:
                    break  # back to the first stream: it runs ahead whenever it can
            assert progressed, "the streams wait for each other"


@pytest.mark.parametrize("save", [False, True], ids=["loads", "saves"])
@pytest.mark.parametrize("first", ["copy", "index"])
def test_staged_copies_overlap_only_where_the_events_allow(monkeypatch, save, first):
    """The staged pipeline (two buffers, host copies on one stream, indexed copies on
    another) run in the worst order its events allow gives the per-run copies' bytes."""
    import vllm.v1.kv_offload.worker as worker

    monkeypatch.setattr(worker, "STAGE_BLOCKS", 4)  # 14 pairs x 3 layers x K/V: 24 units
    g = torch.Generator().manual_seed(7)
    device_blocks = torch.randperm(40, generator=g)[:14].tolist()
    host = [3 + i for i in range(7)] + [25 + i for i in range(7)]
    sides = (device_blocks, host) if save else (host, device_blocks)
    pairs = list(zip(*sides, strict=True))
    results = []
    for staged in (False, True):
        caches = _random_caches(seed=8)
        handler = CPUOffloadingHandler(caches, 40, staged=staged)
        for tier in handler.cpu_caches:
            tier.copy_(torch.randn(tier.shape, generator=torch.Generator().manual_seed(9)))
        if staged:
            handler.stream, handler.index_stream = "copy", "index"
            handler.streams = AdversarialStreams()
            handler._staged_copy(sorted(pairs, key=lambda p: p[1 if save else 0]), save, False)
            assert len(handler.streams.queues["index"]) > 24  # queued, nothing run yet
            handler.streams.drain(first)
        else:
            handler._copy(pairs, save=save, non_blocking=False)
        results.append(caches + handler.cpu_caches)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_consecutive_and_host_scattered_plans_are_not_staged(monkeypatch):
    caches = _random_caches()
    handler = CPUOffloadingHandler(caches, 40, staged=True)
    calls = []
    monkeypatch.setattr(handler, "_staged_copy", _spy(handler._staged_copy, calls))
    handler.transfer(KVOffloadTransfers(loads=[(i, 10 + i) for i in range(20)]))  # one run
    # Scattered on both sides: staging would not make the host side's copies fewer.
    g = torch.Generator().manual_seed(3)
    host, device = torch.randperm(40, generator=g)[:12], torch.randperm(40, generator=g)[:12]
    handler.transfer(
        KVOffloadTransfers(loads=list(zip(host.tolist(), device.tolist(), strict=True)))
    )
    assert calls == []


def _spy(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return wrapped


class FakeHostRegister:
    """Records page-locking calls; each lock takes ``delay`` seconds."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None) -> None:
        import threading

        self.delay, self.fail_at = delay, fail_at
        self.locked: dict[int, int] = {}
        self.unlocked: list[int] = []
        self.started = threading.Event()

    def register(self, address: int, size: int) -> None:
        import time

        self.started.set()
        if self.fail_at is not None and len(self.locked) == self.fail_at:
            raise RuntimeError("cudaHostRegister: out of memory")
        time.sleep(self.delay)
        assert address not in self.locked
        self.locked[address] = size

    def unregister(self, address: int) -> None:
        self.unlocked.append(address)

    @property
    def pair(self):
        return self.register, self.unregister


def test_the_tier_is_page_locked_in_the_background_and_unlocked_on_close():
    caches = _random_caches()
    fake = FakeHostRegister(delay=0.01)
    handler = CPUOffloadingHandler(caches, 40, host_register=fake.pair)
    # Copies work while it locks (pageable memory is only slower).
    handler.transfer(KVOffloadTransfers(saves=[(3, 0)], loads=[(0, 5)]))
    assert handler.pinner.done.wait(10) and handler.pinner.error is None
    tiers = {t.data_ptr(): t.numel() * t.element_size() for t in handler.cpu_caches}
    assert fake.locked == tiers  # every layer's tensor, whole, once
    for layer in caches:
        assert torch.equal(layer[:, 5], layer[:, 3])
    handler.close()
    handler.close()  # once only
    assert sorted(fake.unlocked) == sorted(tiers)


def test_closing_while_locking_stops_and_unlocks_only_what_was_locked():
    fake = FakeHostRegister(delay=0.2)
    handler = CPUOffloadingHandler(_random_caches(num_layers=6), 8, host_register=fake.pair)
    assert fake.started.wait(5)
    handler.close()
    assert 1 <= len(fake.locked) < 6 and sorted(fake.unlocked) == sorted(fake.locked)


def test_a_failed_lock_leaves_the_tier_working_and_pageable(caplog):
    fake = FakeHostRegister(fail_at=1)
    caches = _random_caches()
    handler = CPUOffloadingHandler(caches, 40, host_register=fake.pair)
    assert handler.pinner.done.wait(10)
    assert "out of memory" in str(handler.pinner.error) and len(fake.locked) == 1
    assert "page-locking stopped" in caplog.text
    handler.transfer(KVOffloadTransfers(saves=[(2, 7)]))
    assert torch.equal(handler.cpu_caches[0][:, 7], caches[0][:, 2])
    handler.close()
    assert fake.unlocked == list(fake.locked)


def test_a_dropped_handler_unlocks_its_tier():
    import gc

    fake = FakeHostRegister()
    handler = CPUOffloadingHandler(_random_caches(), 8, host_register=fake.pair)
    handler.pinner.done.wait(10)
    del handler
    gc.collect()
    assert len(fake.unlocked) == len(fake.locked) == 3


def test_cuda_host_register_checks_each_call_through_torchs_bindings(monkeypatch):
    """The CUDA calls, against a stand-in for ``torch.cuda.cudart()``: portable locking on
    the tier's device, an error code raised with the driver's message."""
    import contextlib
    import enum

    from vllm.v1.kv_offload.worker import cuda_host_register

    class Error(enum.Enum):
        success = 0
        already = 712

    calls = []

    class Cudart:
        cudaError = Error

        def cudaHostRegister(self, address, size, flags):
            calls.append(("register", address, size, flags))
            return Error.already if address == 0xBAD else Error.success

        def cudaHostUnregister(self, address):
            calls.append(("unregister", address))
            return Error.success

        def cudaGetErrorString(self, err):
            return "part of the range is already page-locked"

    devices = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(
        torch.cuda, "device", lambda d: devices.append(d) or contextlib.nullcontext()
    )
    register, unregister = cuda_host_register(torch.device("cuda", 1))
    register(0x1000, 4096)
    unregister(0x1000)
    assert calls == [("register", 0x1000, 4096, 1), ("unregister", 0x1000)]
    assert devices == [torch.device("cuda", 1)]
    with pytest.raises(RuntimeError, match="cudaHostRegister: part of the range"):
        register(0xBAD, 4096)
