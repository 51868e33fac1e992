"""The hybrid KV cache's runner side (``vllm/v1/worker/kv_cache_groups.py``): how a
model's layers form groups over shared tensors, a step's metadata built per group (eager
and replayed from stand-in CUDA graphs) giving the tokens of a cache that keeps every
block, and engines on sliding-window checkpoints (Qwen2, Gemma 3 with seven sliding
groups, gpt-oss) whose greedy tokens equal transformers' while their sliding layers'
blocks are freed and reused."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.tiny_models import TINY_LLAMA, hf_greedy, load_cpu_runner
from tests.utils import copy_benchmark_tokenizer
from tests.v1.attention.test_torch_flash import install, ref_varlen_attn
from tests.v1.attention.test_triton_decode import emulated_kernel
from tests.v1.core.conftest import make_request
from tests.v1.worker.test_cuda_graph import ReplayingGraph
from tests.v1.worker.test_model_runner_inputs import new_req, sched_out
from vllm import LLM, SamplingParams
from vllm.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.v1.attention.backends import triton_decode
from vllm.v1.attention.backends.abstract import GroupedMetadata, layer_metadata
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend
from vllm.v1.worker.kv_cache_groups import plan_kv_cache_groups

BLOCK = 4
WINDOW = 8


# -- the plan -------------------------------------------------------------------------------
def test_groups_of_each_kind_of_model():
    # gpt-oss: sliding and full layers alternate, 12 of each -> 2 groups over 12 tensors.
    g = plan_kv_cache_groups((128, None) * 12)
    assert g.windows == (None, 128) and g.num_tensors == 12
    assert g.layer_group == (1, 0) * 12 and g.layer_tensor == tuple(i // 2 for i in range(24))
    # Gemma 3 (26 layers, every sixth full): 4 full layers -> groups of 4, the 22 sliding
    # layers in six groups (the last of two), 4 tensors instead of 26.
    windows = tuple(None if i % 6 == 5 else 1024 for i in range(26))
    g = plan_kv_cache_groups(windows)
    assert g.windows == (None,) + (1024,) * 6 and g.num_tensors == 4
    assert [g.layer_group.count(k) for k in range(7)] == [4, 4, 4, 4, 4, 4, 2]
    assert all(g.layer_tensor[i] == j for j, i in enumerate((5, 11, 17, 23)))
    # Every layer sliding (Mistral v0.1): one group that frees, a tensor a layer.
    g = plan_kv_cache_groups((16,) * 4)
    assert g.windows == (16,) and g.num_tensors == 4 and g.layer_tensor == (0, 1, 2, 3)
    # Two windows and full layers: a group per kind, full first.
    assert plan_kv_cache_groups((None, 8, 16, 8, 16, None)).windows == (None, 8, 16)
    # Off, or nothing slides: one group of every layer.
    for windows, hybrid in (((128, None) * 2, False), ((None,) * 3, True)):
        g = plan_kv_cache_groups(windows, hybrid)
        assert g.windows == (None,) and g.num_tensors == len(windows) and not g.hybrid
    with pytest.raises(ValueError, match="no attention layers"):
        plan_kv_cache_groups(())


def test_layer_metadata():
    assert layer_metadata("m", 3) == ["m"] * 3
    grouped = GroupedMetadata(["full", "slide"], (1, 0, 1))
    assert layer_metadata(grouped, 3) == ["slide", "full", "slide"]
    with pytest.raises(ValueError, match="metadata for 3 layers, the model has 2"):
        layer_metadata(grouped, 2)


# -- the runner over two groups ---------------------------------------------------------------
def save_qwen2(path, **fields) -> torch.nn.Module:
    """Layer 0 attends to everything, layer 1 to a window of ``WINDOW``."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        **{**TINY_LLAMA, **fields}, sliding_window=WINDOW, use_sliding_window=True,
        max_window_layers=1,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid-qwen2")
    save_qwen2(path)
    return path


def make_runner(path, monkeypatch, hybrid: bool):
    """A CPU runner with TORCH_FLASH_ATTN's decode path (the Triton kernel emulated)."""
    install(monkeypatch, ref_varlen_attn)
    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated_kernel([]))
    config = VllmConfig(
        model_config=ModelConfig(model=str(path)),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_model_len=96, max_num_batched_tokens=96, max_num_seqs=8,
            disable_hybrid_kv_cache_manager=not hybrid,
        ),
    )  # fmt: skip
    runner = load_cpu_runner(config)
    a = runner.arch
    backend = TorchFlashAttentionBackend(
        a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, "cpu", BLOCK
    )
    backend.decode_kernel = "triton"
    runner.attn_backend = backend
    runner.install_attention_backend()
    runner.initialize_kv_cache(64)
    return runner


PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13], "c": list(range(20, 41))}
FULL = {"a": [3, 9], "b": [7], "c": [12, 2, 15, 16, 40, 41]}
SLIDE = {"a": [20, 21], "b": [22], "c": [23, 24, 25, 26, 27, 28]}


def run_steps(runner, hybrid: bool) -> list[dict[str, list[int]]]:
    """Three prompts, then six decode steps (blocks opened as positions need them): with
    two groups each request has a table per group; the sliding group's blocks behind
    the window are overwritten with garbage after the prompts (another request's K/V),
    which no later step may read."""
    full, slide = {r: list(v) for r, v in FULL.items()}, {r: list(v) for r, v in SLIDE.items()}
    extra = iter(range(44, 64))

    def tables(r, ids_full, ids_slide):
        return (ids_full, ids_slide) if hybrid else ids_full

    new = [new_req(r, p, tables(r, full[r], slide[r]), 0) for r, p in PROMPTS.items()]
    tokens = [runner.execute_model(sched_out(new=new, num_scheduled={
        r: len(p) for r, p in PROMPTS.items()})).sampled_token_ids]  # fmt: skip
    if hybrid:  # c's positions 0..11 are behind every later token's window (13 - 8 + 1 = 6..)
        for block in (23,):
            runner.kv_caches[1][:, block] = 1e4 * torch.randn_like(runner.kv_caches[1][:, block])
    computed = {r: len(p) for r, p in PROMPTS.items()}
    for _ in range(6):
        cached = []
        for r in PROMPTS:
            new_full, new_slide = [], []
            if computed[r] % BLOCK == 0 and computed[r] // BLOCK >= len(full[r]):
                new_full, new_slide = [next(extra)], [next(extra)]
                full[r] += new_full
                slide[r] += new_slide
            cached.append((r, tables(r, new_full, new_slide), computed[r]))
        tokens.append(
            runner.execute_model(
                sched_out(cached=cached, num_scheduled={r: 1 for r in PROMPTS})
            ).sampled_token_ids
        )
        for r in PROMPTS:
            computed[r] += 1
    return tokens


def test_grouped_steps_eager_and_replayed_equal_one_group(qwen2, monkeypatch):
    one = make_runner(qwen2, monkeypatch, hybrid=False)
    assert one.kv_groups.windows == (None,) and one.kv_caches[0] is not one.kv_caches[1]
    expected = run_steps(one, hybrid=False)

    eager = make_runner(qwen2, monkeypatch, hybrid=True)
    groups = eager.kv_groups
    assert groups.windows == (None, WINDOW) and groups.layer_group == (0, 1)
    assert eager.kv_caches[0] is eager.kv_caches[1]  # one tensor: a block is one group's
    assert eager.get_kv_cache_bytes_per_block() * 2 == one.get_kv_cache_bytes_per_block()
    assert run_steps(eager, hybrid=True) == expected

    replayed = make_runner(qwen2, monkeypatch, hybrid=True)
    replayed.capture_model(graph_factory=ReplayingGraph)
    assert run_steps(replayed, hybrid=True) == expected
    assert replayed.decode_graphs.num_replays == 6


def test_hybrid_with_a_draft_unless_every_layer_slides(qwen2, tmp_path, monkeypatch):
    assert make_runner(qwen2, monkeypatch, hybrid=True).kv_cache_windows == (None, WINDOW)
    assert make_runner(qwen2, monkeypatch, hybrid=False).kv_cache_windows == (None,)

    def with_draft(target) -> tuple:
        config = VllmConfig(
            model_config=ModelConfig(model=str(target)),
            speculative_config=SpeculativeConfig(
                {"method": "draft_model", "model": str(qwen2), "num_speculative_tokens": 2}
            ),
        )
        return load_cpu_runner(config).kv_cache_windows

    assert with_draft(qwen2) == (None, WINDOW)  # the draft caches in the full group's blocks
    torch.manual_seed(0)
    mistral = transformers.MistralConfig(**TINY_LLAMA, sliding_window=WINDOW)
    transformers.MistralForCausalLM(mistral).save_pretrained(tmp_path)
    assert with_draft(tmp_path) == (None,)  # no group holds every position


# -- engines ----------------------------------------------------------------------------------
def engine_tokens(path, prompts, max_tokens: int, **engine) -> tuple[list, dict]:
    """Greedy tokens of ``prompts`` (together, then the last again: a prefix hit), the
    peak KV bytes in use, the hit, and the preemptions; every step's invariants checked."""
    llm = LLM(model=str(path), block_size=BLOCK, max_num_batched_tokens=16, max_model_len=160,
              enable_prefix_caching=True, **engine)  # fmt: skip
    try:
        sched = llm.engine_core.scheduler
        kv = sched.kv_cache_manager
        bytes_per_block = llm.engine_core.model_runner.get_kv_cache_bytes_per_block()
        seen = {"peak": 0, "preempted": 0, "windows": kv.windows}
        schedule = sched.schedule

        def checked_schedule():
            out = schedule()
            sched.check_invariants()
            used = kv.block_pool.num_gpu_blocks - 1 - kv.num_free_blocks
            seen["peak"] = max(seen["peak"], used * bytes_per_block)
            seen["preempted"] += len(out.preempted_req_ids)
            return out

        sched.schedule = checked_schedule
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        again = llm.generate({"prompt_token_ids": prompts[-1]}, params)[0]
        seen["hit"] = again.num_cached_tokens
        tokens = [list(o.outputs[0].token_ids) for o in outs] + [list(again.outputs[0].token_ids)]
        assert kv.usage == 0.0  # nothing leaked (cached blocks are free)
    finally:
        llm.shutdown()
    return tokens, seen


def random_prompts(lengths, seed: int) -> list[list[int]]:
    """Prompts of these lengths over SmolLM2's 49,152 token ids, from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]


def served_qwen2(path) -> torch.nn.Module:
    """``save_qwen2`` with SmolLM2's vocabulary and tokenizer: a folder ``LLM`` serves."""
    hf = save_qwen2(path, vocab_size=49152, max_position_embeddings=256)
    copy_benchmark_tokenizer(path)
    return hf


def check_against_transformers(hf, path, lengths, kv_bytes: str, max_tokens: int = 12) -> dict:
    copy_benchmark_tokenizer(path)
    prompts = random_prompts(lengths, 3)
    expected = hf_greedy(hf, prompts, max_tokens)
    expected.append(expected[-1])
    runs = {}
    for hybrid in (True, False):
        tokens, seen = engine_tokens(
            path, prompts, max_tokens, kv_cache_memory=kv_bytes,
            disable_hybrid_kv_cache_manager=not hybrid,
        )  # fmt: skip
        assert tokens == expected, f"hybrid={hybrid}"
        assert seen["hit"] >= 32
        runs[hybrid] = seen
    return runs


def test_qwen2_engine_frees_the_sliding_layers_blocks(tmp_path):
    """Both engines get the same 96 KiB of KV (1 KiB a layer's block): the hybrid one
    holds the sliding layer's window only, so three long prompts run together where the
    one that keeps every block must preempt one of them."""
    hf = save_qwen2(tmp_path, vocab_size=49152, max_position_embeddings=256)
    runs = check_against_transformers(hf, tmp_path, (90, 60, 110), kv_bytes="96KiB")
    assert runs[True]["windows"] == (None, WINDOW) and runs[False]["windows"] == (None,)
    assert runs[True]["preempted"] == 0 < runs[False]["preempted"]


def test_gemma3_engine_over_seven_sliding_groups(tmp_path):
    """Gemma 3's pattern on 8 layers (the sixth full): a full group and seven sliding
    groups of one layer each over one tensor."""
    from tests.model_executor.test_gemma import save_checkpoint

    layer_types = ["full_attention" if i == 5 else "sliding_attention" for i in range(8)]
    hf = save_checkpoint(
        "Gemma3ForCausalLM", tmp_path, vocab_size=49152, num_hidden_layers=8,
        layer_types=layer_types, sliding_window=WINDOW, max_position_embeddings=256,
    )  # fmt: skip
    runs = check_against_transformers(hf, tmp_path, (70, 45), kv_bytes="512KiB", max_tokens=8)
    assert runs[True]["windows"] == (None,) + (WINDOW,) * 7
    assert runs[True]["peak"] < 0.5 * runs[False]["peak"]


def test_gpt_oss_engine_with_sinks_over_two_groups(tmp_path):
    from tests.model_executor.test_gpt_oss import hf_model

    hf = hf_model(vocab_size=49152, sliding_window=WINDOW, max_position_embeddings=256)
    hf.save_pretrained(tmp_path)
    runs = check_against_transformers(hf, tmp_path, (80, 50, 100), kv_bytes="256KiB")
    assert runs[True]["windows"] == (None, WINDOW)


def test_continuum_pins_and_async_scheduling_over_two_groups(tmp_path):
    """Two turns of one job under Continuum: the first turn's blocks stay pinned, the
    second hits its context (the full group's blocks and the sliding group's window);
    async scheduling, the policy's automatic CPU tier and one group give the same
    tokens."""
    served_qwen2(tmp_path)
    (first,) = random_prompts((70,), 5)
    results = {}
    for hybrid, mode, tier in ((True, False, 0), (True, True, 0), (True, False, None),
                               (False, False, 0)):  # fmt: skip
        llm = LLM(model=str(tmp_path), block_size=BLOCK, max_num_batched_tokens=16,
                  max_model_len=160, scheduling_policy="continuum", kv_offloading_size=tier,
                  async_scheduling=mode, disable_hybrid_kv_cache_manager=not hybrid)  # fmt: skip
        try:
            sched = llm.engine_core.scheduler
            assert sched.kv_cache_manager.windows == ((None, WINDOW) if hybrid else (None,))
            assert (sched.kv_cache_manager.offload is not None) == (tier is None)
            outs, prompt = [], first
            for turn in range(2):
                extra = {"job_id": "job", "is_last_step": turn == 1}
                params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                        extra_args=extra)  # fmt: skip
                out = llm.generate({"prompt_token_ids": prompt}, params)[0]
                outs.append((list(out.outputs[0].token_ids), out.num_cached_tokens))
                sched.check_invariants()
                prompt = prompt + list(out.outputs[0].token_ids) + [7, 8, 9]
            assert sched.kv_cache_manager.usage == 0.0  # the last step's blocks are freed
        finally:
            llm.shutdown()
        results[(hybrid, mode, tier)] = outs
    first = results[(True, False, 0)]
    assert all(outs == first for outs in results.values())
    assert first[1][1] >= 76  # the pinned context: 79 tokens, whole blocks


def test_cpu_tier_loads_every_groups_blocks_back(tmp_path, monkeypatch):
    """A pool too small to keep a context (96 KiB) with a CPU tier: the first prompt's
    blocks are evicted by the next ones (saved to the tier, each group's under its own
    key) and loaded back for its second run, whose tokens stay transformers'."""
    from vllm.v1.kv_offload.manager import OffloadManager

    loads = []
    plan_loads = OffloadManager.plan_loads

    def counted(self, cpu_ids, gpu_ids):
        loads.append(len(cpu_ids))
        plan_loads(self, cpu_ids, gpu_ids)

    monkeypatch.setattr(OffloadManager, "plan_loads", counted)
    hf = served_qwen2(tmp_path)
    prompts = random_prompts((100, 90, 110), 7)
    expected = hf_greedy(hf, prompts, 8)
    llm = LLM(model=str(tmp_path), block_size=BLOCK, max_num_batched_tokens=16,
              max_model_len=160, kv_cache_memory="96KiB", kv_offloading_size=0.01)  # fmt: skip
    try:
        kv = llm.engine_core.scheduler.kv_cache_manager
        assert kv.windows == (None, WINDOW) and kv.offload is not None
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        got = [list(llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids)
               for p in prompts]  # fmt: skip
        assert kv.get_computed_blocks(make_request(prompts[0], BLOCK))[1] == 0  # evicted
        again = llm.generate({"prompt_token_ids": prompts[0]}, params)[0]
        llm.engine_core.scheduler.check_invariants()
    finally:
        llm.shutdown()
    assert got == expected
    assert list(again.outputs[0].token_ids) == expected[0]
    assert again.num_cached_tokens >= 96 and sum(loads) > 0


def test_draft_model_over_two_groups(tmp_path):
    """A hybrid target as its own draft (its layers cached at the full group's block ids):
    the tokens of plain decoding, nearly every draft kept, a tight pool's blocks reused."""
    hf = served_qwen2(tmp_path)
    prompts = random_prompts((70, 40, 90), 9)
    expected = hf_greedy(hf, prompts, 16)
    llm = LLM(model=str(tmp_path), block_size=BLOCK, max_num_batched_tokens=32,
              max_model_len=160, kv_cache_memory="160KiB",
              speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3})  # fmt: skip
    try:
        sched = llm.engine_core.scheduler
        assert sched.kv_cache_manager.windows == (None, WINDOW)
        drafted = [0, 0]  # drafts, kept: the scheduler's per-report deltas summed
        make_stats = sched.make_stats

        def summed(*args, **kwargs):
            stats = make_stats(*args, **kwargs)
            spec = stats.spec_decoding_stats
            drafted[0] += spec.num_draft_tokens
            drafted[1] += spec.num_accepted_tokens
            return stats

        sched.make_stats = summed
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        make_stats()
        sched.check_invariants()
        assert sched.kv_cache_manager.usage == 0.0
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert drafted[0] > 0 and drafted[1] >= 0.9 * drafted[0], drafted


def test_start_up_log_counts_what_the_groups_hold(qwen2, tmp_path, caplog):
    """One sequence's capacity and the concurrency the log prints count a sliding group's
    window, not the context; with every layer sliding, any length fits."""
    import logging

    torch.manual_seed(0)
    mistral = transformers.MistralConfig(**TINY_LLAMA, sliding_window=WINDOW)
    transformers.MistralForCausalLM(mistral).save_pretrained(tmp_path)
    # Two groups, 40 usable blocks of 4, steps of 64: the window's group holds at most
    # cdiv(7 + 64, 4) + 1 = 19 blocks, so one sequence takes 84 tokens (21 + 19 blocks); a
    # 64-token request needs 16 + 16 blocks: 1.25 of them fit.
    cases = ((qwen2, "; 84 tokens; maximum concurrency for 64 tokens per request: 1.25x"),
             (tmp_path, "; a sequence of any length; "))  # fmt: skip
    for path, expected in cases:
        config = VllmConfig(
            model_config=ModelConfig(model=str(path)),
            cache_config=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=41),
            scheduler_config=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64),
        )
        runner = load_cpu_runner(config)
        with caplog.at_level(logging.INFO, logger="vllm.v1.worker.model_runner"):
            assert runner.determine_num_blocks() == 41
        assert expected in caplog.text, caplog.text
        caplog.clear()
