"""KV cache sizing from live GPU memory (``gpu_memory.py``, ``ModelRunner.determine_num_blocks``).

The arithmetic runs against a simulated device (``FakeCuda`` replaces the few
``torch.cuda`` functions the sizing reads). The scenario, in GiB, on an 80 GiB card at
utilization 0.9 (requested 72):

    start          0.5 used by the CUDA context / other processes, free 79.5
    load           16 weights allocated; the allocator also caches 32 GiB of freed staging
    profile step   3 GiB of activations, freed after; cuBLAS takes 0.25 GiB non-torch
    after          empty_cache returns the 32 cached GiB: free 79.5 - 16 - 0.25 = 63.25

    kv = 72 - (79.5 - 63.25) - 3 = 52.75 GiB

The old sizing (``total * utilization - (total - free)``, read with the staging still
cached) gave 72 - (0.5 + 16 + 32) = 23.5 GiB.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import load_cpu_runner, save_tiny_llama
from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
from vllm.v1.worker.gpu_memory import (
    GiB,
    MemorySnapshot,
    measure_before_load,
    profile_kv_cache_budget,
    requested_memory,
)
from vllm.v1.worker.model_runner import ModelRunner


class FakeCuda:
    """One device: torch's live tensors, its cache, and memory torch does not own."""

    def __init__(self, total: int, other: int) -> None:
        self.total = total
        self.other = other  # not torch's: contexts, other processes, library workspaces
        self.allocated = 0
        self.peak = 0
        self.cached = 0  # reserved by the allocator, no live tensor
        self.calls: list[str] = []

    def alloc(self, n: int) -> None:
        take = min(n, self.cached)
        self.cached -= take
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n
        self.cached += n

    def reserved(self) -> int:
        return self.allocated + self.cached

    def install(self, monkeypatch) -> None:
        dev = "cuda"
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "memory_stats", self.memory_stats)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=dev: self.reserved())
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=dev: self.calls.append("sync"))

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.other - self.reserved(), self.total

    def memory_stats(self, device=None) -> dict[str, int]:
        return {
            "allocated_bytes.all.current": self.allocated,
            "allocated_bytes.all.peak": self.peak,
        }

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def reset_peak(self, device=None) -> None:
        self.calls.append("reset_peak")
        self.peak = self.allocated


CUDA = torch.device("cuda")


def _load(fake: FakeCuda) -> None:
    """16 GiB of bf16 weights cast from a 32 GiB fp32 copy, freed (and cached)."""
    fake.alloc(32 * GiB)
    fake.alloc(16 * GiB)
    fake.free(32 * GiB)


def _profile_step(fake: FakeCuda):
    def step() -> None:
        fake.alloc(3 * GiB)
        fake.free(3 * GiB)
        fake.other += GiB // 4  # cuBLAS workspace

    return step


def test_budget_counts_live_allocations_not_the_allocators_cache(monkeypatch):
    fake = FakeCuda(80 * GiB, other=GiB // 2)
    fake.install(monkeypatch)
    start = measure_before_load(CUDA)
    _load(fake)
    # What the old sizing read at this point: the cached staging counted as used.
    free, total = torch.cuda.mem_get_info(CUDA)
    assert int(total * 0.9) - (total - free) == int(23.5 * GiB)
    budget = profile_kv_cache_budget(CUDA, 0.9, start, _profile_step(fake))
    assert budget.requested == 72 * GiB
    assert budget.consumed == 16 * GiB + GiB // 4
    assert budget.activation_peak == 3 * GiB
    assert budget.weights == 16 * GiB
    assert budget.non_torch_increase == GiB // 4
    assert budget.kv_cache_bytes == int(52.75 * GiB)
    # The peak was reset after loading (the staging's 32 GiB peak is not an activation)
    # and caches emptied before each measurement.
    assert fake.calls.index("reset_peak") < fake.calls.index("sync")
    assert fake.calls[-1] == "empty_cache"
    # Weights + KV + peak activations + non-torch stay within the requested share.
    used = budget.kv_cache_bytes + fake.allocated + budget.activation_peak + GiB // 4
    assert used == 72 * GiB


def test_memory_other_processes_hold_is_not_this_engines(monkeypatch):
    # 20 GiB held by another process does not shrink the share, as in vLLM: utilization
    # is this engine's part of the device (here 0.5 of 80 GiB).
    fake = FakeCuda(80 * GiB, other=20 * GiB)
    fake.install(monkeypatch)
    start = measure_before_load(CUDA)
    _load(fake)
    budget = profile_kv_cache_budget(CUDA, 0.5, start, _profile_step(fake))
    assert budget.kv_cache_bytes == 40 * GiB - (16 * GiB + GiB // 4) - 3 * GiB


def test_less_free_at_start_than_requested_is_refused(monkeypatch):
    fake = FakeCuda(80 * GiB, other=20 * GiB)
    fake.install(monkeypatch)
    start = measure_before_load(CUDA)
    assert start.free == 60 * GiB and start.non_torch == 20 * GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.9 asks for 72.00 GiB"):
        requested_memory(start, 0.9)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        profile_kv_cache_budget(CUDA, 0.9, start, lambda: None)


def test_snapshot_reads_torch_and_the_device(monkeypatch):
    fake = FakeCuda(8 * GiB, other=GiB)
    fake.install(monkeypatch)
    fake.alloc(2 * GiB)
    fake.free(GiB)
    snap = MemorySnapshot.measure(CUDA)
    assert (snap.free, snap.total) == (5 * GiB, 8 * GiB)
    assert (snap.torch_allocated, snap.torch_peak, snap.torch_reserved) == (GiB, 2 * GiB, 2 * GiB)
    assert snap.non_torch == GiB


# -- the runner: precedence of the flags, and the profile step ---------------------------------
class Arch:
    num_layers, num_kv_heads, head_dim, num_heads = 2, 2, 8, 4


def _cuda_runner(monkeypatch, fake: FakeCuda, **cache) -> ModelRunner:
    """A runner whose device is ``cuda`` (simulated): no model, a 2-layer shape."""
    fake.install(monkeypatch)
    config = VllmConfig(cache_config=CacheConfig(block_size=16, **cache))
    runner = ModelRunner(config, device="cuda")
    runner.arch = Arch()
    runner.dtype = torch.bfloat16
    runner.memory_before_load = measure_before_load(CUDA)
    monkeypatch.setattr(runner, "reserve_penalty_table", lambda: None)  # no real device
    return runner


PER_BLOCK = 2 * 2 * 16 * 2 * 8 * 2  # K and V, 2 layers, 16 tokens, 2 heads x 8, bf16


def test_runner_sizes_from_memory_after_its_profile_run(monkeypatch):
    fake = FakeCuda(GiB, other=0)
    runner = _cuda_runner(monkeypatch, fake, gpu_memory_utilization=0.5)
    fake.alloc(100 << 20)  # the weights
    steps = []
    monkeypatch.setattr(runner, "profile_run", lambda: steps.append(fake.alloc(10 << 20)))
    # The penalty tables' rows, allocated for good before the profile (simulated here).
    monkeypatch.setattr(runner, "reserve_penalty_table", lambda: steps.append(fake.alloc(3 << 20)))
    assert runner.get_kv_cache_bytes_per_block() == PER_BLOCK
    # 512 MiB - 100 MiB weights - 3 MiB penalty tables - 10 MiB the profile step left
    # allocated (counted as consumed, its peak over what stays is 0).
    assert runner.determine_num_blocks() == ((512 - 113) << 20) // PER_BLOCK
    assert len(steps) == 2


def test_penalty_table_is_reserved_for_every_sequence(monkeypatch):
    threads = torch.get_num_threads()
    config = VllmConfig(cache_config=CacheConfig(block_size=16))
    runner = ModelRunner(config, device="cpu")
    torch.set_num_threads(threads)
    runner.arch = type("A", (), {"vocab_size": 1000})()
    runner.reserve_penalty_table()
    table = runner.penalty_table
    sc = config.scheduler_config
    assert table.capacity == sc.max_num_seqs and table.vocab == 1000
    assert table.met.shape[1] == min(sc.max_model_len, 4096)
    runner.reserve_penalty_table()  # once
    assert runner.penalty_table is table
    runner.penalty_table, runner.use_penalty_tables = None, False
    runner.reserve_penalty_table()  # tables off: nothing
    assert runner.penalty_table is None


@pytest.mark.parametrize(
    ("cache", "blocks"),
    [
        (dict(num_gpu_blocks_override=7), 7),
        (dict(kv_cache_memory_bytes=64 * PER_BLOCK), 64),
        (dict(num_gpu_blocks_override=7, kv_cache_memory_bytes=64 * PER_BLOCK), 7),
    ],
)
def test_explicit_sizes_take_precedence_without_profiling(monkeypatch, cache, blocks):
    fake = FakeCuda(GiB, other=0)
    runner = _cuda_runner(monkeypatch, fake, **cache)

    def no_profile():
        raise AssertionError("an explicit KV size must not profile")

    monkeypatch.setattr(runner, "profile_run", no_profile)
    assert runner.determine_num_blocks() == blocks


def test_no_room_for_a_kv_cache_names_the_flags(monkeypatch):
    fake = FakeCuda(GiB, other=0)
    runner = _cuda_runner(monkeypatch, fake, gpu_memory_utilization=0.1)
    fake.alloc(200 << 20)  # weights alone exceed 0.1 GiB
    monkeypatch.setattr(runner, "profile_run", lambda: None)
    with pytest.raises(ValueError, match="no room for a KV cache.*--gpu-memory-utilization"):
        runner.determine_num_blocks()


def test_sizing_needs_the_baseline_of_load_model(monkeypatch):
    runner = _cuda_runner(monkeypatch, FakeCuda(GiB, other=0))
    runner.memory_before_load = None
    with pytest.raises(RuntimeError, match="load_model first"):
        runner.determine_num_blocks()


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory):
    """A CPU runner on a tiny random Llama (max_model_len 96, 40-token steps)."""
    path = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(path)
    from vllm.config import ModelConfig

    config = VllmConfig(
        model_config=ModelConfig(model=str(path)),
        cache_config=CacheConfig(block_size=16),
        scheduler_config=SchedulerConfig(
            max_model_len=96, max_num_batched_tokens=40, max_num_seqs=3
        ),
    )
    return load_cpu_runner(config)


def test_profile_run_is_the_largest_step(tiny_runner, monkeypatch):
    seen = {}
    model = tiny_runner.model
    real_forward = model.forward

    def forward(ids, positions, meta, kv_caches):
        seen.update(ids=ids.shape[0], positions=positions.tolist(), caches=kv_caches)
        return real_forward(ids, positions, meta, kv_caches)

    monkeypatch.setattr(model, "forward", forward)
    probs = tiny_runner.profile_run()
    # 40 tokens: the last chunk of a 96-token prompt, positions 56..95.
    assert seen["ids"] == 40 and seen["positions"] == list(range(56, 96))
    # A scratch cache of 2 blocks (the null block and the aliased one), not the pool.
    assert len(seen["caches"]) == 2 and seen["caches"][0].shape[1] == 2
    assert not tiny_runner.kv_caches
    # The sampler's rows: max_num_seqs of them, probabilities over the vocabulary.
    assert probs.shape == (3, 96) and torch.allclose(probs.sum(-1), torch.ones(3))


def test_profile_run_without_chunking_fills_the_budget_with_whole_prompts(tiny_runner):
    sc = SchedulerConfig(
        max_model_len=32, max_num_batched_tokens=80, max_num_seqs=8, enable_chunked_prefill=False
    )
    config = VllmConfig(
        model_config=tiny_runner.config.model_config,
        cache_config=tiny_runner.config.cache_config,
        scheduler_config=sc,
    )
    runner = ModelRunner.__new__(ModelRunner)
    runner.__dict__.update(tiny_runner.__dict__, config=config)
    # 80 tokens as prompts of at most 32: 32 + 32 + 16; the logits of the last 8 rows.
    assert runner.profile_run().shape == (8, 96)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pool_and_weights_stay_under_utilization_on_a_real_device(tmp_path):
    """Load a ~100 MB bf16 model, size the pool at utilization 0.3, allocate it, run the
    profile step again on the real cache: this engine's use stays under 0.3 * total."""
    import transformers

    from vllm.config import ModelConfig

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    util = 0.3
    config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), dtype="bfloat16"),
        cache_config=CacheConfig(gpu_memory_utilization=util),
        scheduler_config=SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048),
    )
    runner = ModelRunner(config, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    runner.load_model()
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    weights += sum(b.numel() * b.element_size() for b in runner.model.buffers())
    # Loaded in bf16 directly: the load's peak is the weights (no fp32 staging, which
    # would be 3x: fp32 copy + bf16 cast).
    assert torch.cuda.max_memory_allocated() < 1.1 * weights + (64 << 20)
    start = runner.memory_before_load
    num_blocks = runner.determine_num_blocks()
    runner.initialize_kv_cache(num_blocks)
    kv = num_blocks * runner.get_kv_cache_bytes_per_block()
    assert kv > 0
    torch.cuda.reset_peak_memory_stats()
    runner.profile_run()
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    torch.cuda.empty_cache()  # the step's activations are counted once, as its peak
    free, total = torch.cuda.mem_get_info()
    used = start.free - free + transient  # this engine: weights, KV, non-torch, peak
    # Up to 64 MiB over: the driver's free memory moves by library workspaces the second
    # profile step creates (0.3 MB over on an H200, 2026-11-27).
    assert used <= util * total + (64 << 20), (used / GiB, util * total / GiB)
    # And the pool is most of what was left (not lost to cached staging).
    assert used >= 0.9 * util * total - (1 << 30), (used / GiB, util * total / GiB)
