"""The host-memory KV tier's CUDA path (issue 28): pinned host tensors, copies on a side
stream ordered against the compute stream, and an engine that reloads evicted prefixes
from the tier with the same greedy tokens. Run on an H200 (2026-11-27); the CPU path's
tests are tests/v1/kv_offload/."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.test_load_format import config_only_folder
from tests.utils import copy_benchmark_tokenizer
from vllm.v1.core.sched.output import KVOffloadTransfers
from vllm.v1.kv_offload.worker import CPUOffloadingHandler

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def caches(num_layers=3, num_blocks=64, block=16, heads=2, dim=64, dtype=torch.bfloat16):
    shape = (2, num_blocks, block, heads, dim)
    return [torch.randn(shape, device=CUDA).to(dtype) for _ in range(num_layers)]


def test_tier_is_pinned_in_the_background_and_copies_on_its_own_stream():
    kv = caches()
    handler = CPUOffloadingHandler(kv, 32)
    assert handler.pinner is not None and handler.pinner.done.wait(60)
    assert handler.pinner.error is None
    assert all(t.is_pinned() and t.device.type == "cpu" for t in handler.cpu_caches)
    assert handler.stream is not None and handler.stream != torch.cuda.current_stream()
    handler.close()  # unlocked: the tensors are plain memory again
    assert not any(t.is_pinned() for t in handler.cpu_caches)


def test_a_save_sees_the_compute_streams_last_write_and_a_load_is_seen_by_the_next():
    kv = caches()
    handler = CPUOffloadingHandler(kv, 32)
    # A long kernel on the compute stream, then writes to blocks 1-8: the save (enqueued
    # at once, no host sync) must wait for them.
    big = torch.randn(4096, 4096, device=CUDA)
    for _ in range(20):
        big = big @ big / 64
    for layer in kv:
        layer[:, 1:9].fill_(7)
    handler.transfer(KVOffloadTransfers(saves=[(b, b - 1) for b in range(1, 9)]))
    # The compute stream waits for the side stream: reading the loaded blocks right away
    # (no sync) sees the tier's bytes. Load tier blocks 0-7 into 20-27, scattered order
    # into 40-47 in reverse.
    handler.transfer(
        KVOffloadTransfers(loads=[(t, 20 + t) for t in range(8)] + [(t, 47 - t) for t in range(8)])
    )
    got = [(layer[:, 20:28].float().sum(), layer[:, 40:48].float().sum()) for layer in kv]
    torch.cuda.synchronize()
    expected = 7.0 * kv[0][:, 20:28].numel()
    for tier in handler.cpu_caches:
        assert torch.all(tier[:, :8] == 7)
    for a, b in got:
        assert a.item() == expected and b.item() == expected


def test_staged_scattered_copies_equal_per_block_copies_on_cuda():
    """A plan scattered on the device side goes through the staging buffer (a few host
    copies, one indexed copy per layer and K/V) and leaves cache and tier bitwise as the
    per-block copies do; read right after, with no host sync."""
    g = torch.Generator().manual_seed(4)
    device_blocks = torch.randperm(64, generator=g).tolist()
    plan = KVOffloadTransfers(
        saves=list(zip(device_blocks[:20], range(20), strict=True)),
        loads=list(zip(range(20, 44), device_blocks[20:44], strict=True)),
    )
    results = []
    for staged in (False, True):
        torch.manual_seed(5)
        kv = caches()
        handler = CPUOffloadingHandler(kv, 64, staged=staged)
        for i, tier in enumerate(handler.cpu_caches):
            tier.copy_(torch.full(tier.shape, float(i)).to(tier.dtype) + kv[i].cpu()[:, :1])
        handler.transfer(plan)
        results.append(([layer.clone() for layer in kv], [t.clone() for t in handler.cpu_caches]))
    torch.cuda.synchronize()
    for a, b in zip(results[0][0] + results[0][1], results[1][0] + results[1][1], strict=True):
        assert torch.equal(a.cpu(), b.cpu())


def test_the_staged_pipeline_waits_for_the_compute_stream_and_is_waited_for(monkeypatch):
    """Scattered saves and loads through the two-stream staged pipeline (small chunks, so
    both buffers are reused many times): the gathers see the compute stream's last writes
    behind a long kernel, and the compute stream's reads right after see the scatters."""
    import vllm.v1.kv_offload.worker as worker

    monkeypatch.setattr(worker, "STAGE_BLOCKS", 4)
    kv = caches(num_layers=4, num_blocks=64)
    handler = CPUOffloadingHandler(kv, 64)
    assert handler.staged and handler.index_stream is not None
    staged = []
    real = handler._staged_copy
    monkeypatch.setattr(handler, "_staged_copy", lambda *a: staged.append(a[1]) or real(*a))
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(6)).tolist()
    saved, loaded = blocks[:16], blocks[16:32]
    # Device indices made first: a list index would copy from pageable memory, a sync.
    saved_idx, loaded_idx = (torch.tensor(b, device=CUDA) for b in (saved, loaded))
    torch.cuda.synchronize()
    big = torch.randn(4096, 4096, device=CUDA)
    for _ in range(20):
        big = big @ big / 64
    for i, layer in enumerate(kv):
        layer.index_fill_(1, saved_idx, float(i + 1))  # behind the long kernel
    handler.transfer(KVOffloadTransfers(saves=list(zip(saved, range(16), strict=True))))
    handler.transfer(KVOffloadTransfers(loads=list(zip(range(16), loaded, strict=True))))
    sums = [layer.index_select(1, loaded_idx).float().sum() for layer in kv]  # no sync
    torch.cuda.synchronize()
    assert staged == [True, False]  # both plans went through the pipeline
    for i, (tier, total) in enumerate(zip(handler.cpu_caches, sums, strict=True)):
        assert torch.all(tier[:, :16] == i + 1)
        assert total.item() == (i + 1) * kv[i][:, loaded].numel()


def test_round_trip_is_bitwise_for_every_layer_and_dtype():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kv = caches(dtype=dtype)
        before = [layer[:, 5:13].clone() for layer in kv]
        handler = CPUOffloadingHandler(kv, 16)
        handler.transfer(KVOffloadTransfers(saves=[(5 + i, i) for i in range(8)]))
        for layer in kv:
            layer[:, 5:13].zero_()
        handler.transfer(KVOffloadTransfers(loads=[(i, 5 + i) for i in range(8)]))
        torch.cuda.synchronize()
        for layer, old in zip(kv, before, strict=True):
            assert torch.equal(layer[:, 5:13], old), dtype


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_engine_reloads_evicted_prefixes_from_the_tier_on_cuda(tmp_path, async_scheduling):
    # A small random model (dummy weights in bf16) and a pool of 7 usable blocks: each
    # prompt evicts the others; the second round finds them in the tier (async: the
    # tier's copies planned for a step launched while the last one runs).
    from vllm import LLM, SamplingParams

    config_only_folder(tmp_path, vocab_size=49152, max_position_embeddings=512)
    copy_benchmark_tokenizer(tmp_path)
    prompts = [[100 + 50 * i + t for t in range(60)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kwargs = dict(model=str(tmp_path), load_format="dummy", max_model_len=512)
    big = LLM(**kwargs, num_gpu_blocks_override=64)
    expected = [big.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids
                for p in prompts * 2]  # fmt: skip
    big.shutdown()
    del big
    llm = LLM(**kwargs, num_gpu_blocks_override=8, kv_offloading_size=0.05,
              async_scheduling=async_scheduling)  # fmt: skip
    try:
        assert llm.engine_core.model_runner.kv_offload.stream is not None
        got = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts * 2]
        assert [g.outputs[0].token_ids for g in got] == expected
        for out in got[3:]:
            assert out.num_cached_tokens == 48
        sched = llm.engine_core.scheduler
        sched.check_invariants()
        assert sched.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()
