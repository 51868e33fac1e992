"""The engine over a model with linear-attention layers (Qwen3.5's Gated DeltaNet): each
running request's recurrent states in a slot of their own (layers/recurrent.py), prefix
hits restored from checkpoints of those states (state_checkpoints.py), the flags that
cannot work refused. The model itself is checked against transformers in
tests/model_executor/test_qwen3_next.py; here the engine's scheduling around it (chunks,
mixed batches, preemption, async steps, a job's next turn) must keep transformers'
greedy tokens, and no slot may leak."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.recurrent_checks import oracle_proposer
from tests.tiny_models import hf_greedy
from tests.utils import copy_benchmark_tokenizer

VOCAB = 49152  # the SmolLM2 tokenizer copied in


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """A tiny random Qwen3.5 (three Gated DeltaNet layers, one gated full-attention
    layer) saved by transformers, with the SmolLM2 tokenizer: (path, hf model)."""
    import transformers

    path = tmp_path_factory.mktemp("qwen35")
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # the zero-centred norms and the decay away from their inits
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(path)
    copy_benchmark_tokenizer(path)
    return path, hf


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in (5, 23, 41, 2)[:n]]


def _check_slots(llm) -> None:
    """Every state slot free or held by a request the runner holds (the last step's
    finished ones are dropped with the next step): none leaked."""
    runner = llm.engine_core.model_runner
    held = [s.state_slot for s in runner.requests.values()]
    slots = llm.vllm_config.scheduler_config.max_num_seqs
    assert sorted(runner._free_state_slots + held) == list(range(slots))


def _generate(path, prompts, max_tokens, **kwargs):
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(path), kv_cache_memory="16MiB", **kwargs)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        _check_slots(llm)
        return [list(o.outputs[0].token_ids) for o in outs], llm.vllm_config
    finally:
        llm.shutdown()


def test_chunked_mixed_batches_match_transformers(qwen35):
    """Four prompts at once in 16-token steps: fresh chunks, continued chunks and decodes
    in one batch, each sequence in its own slot; with and without prefix caching."""
    path, hf = qwen35
    prompts = _prompts(4)
    expected = hf_greedy(hf, prompts, 8)
    for caching in (True, False):
        got, _ = _generate(path, prompts, 8, max_num_batched_tokens=16,
                           enable_prefix_caching=caching)  # fmt: skip
        assert got == expected, caching


def test_async_scheduling_matches(qwen35):
    path, hf = qwen35
    prompts = _prompts(3)
    got, _ = _generate(path, prompts, 6, max_num_batched_tokens=16, async_scheduling=True)
    assert got == hf_greedy(hf, prompts, 6)


def test_preempted_requests_recompute_from_a_fresh_state(qwen35):
    """A pool of a few blocks: requests are preempted (their slots given back) and
    resumed from their first token in a new slot; tokens still transformers'."""
    from vllm import LLM, SamplingParams

    path, hf = qwen35
    prompts = [_prompts(4)[i] for i in (0, 1, 3)]  # 5, 23 and 2 tokens, each 40 more
    expected = hf_greedy(hf, prompts, 40)
    llm = LLM(model=str(path), num_gpu_blocks_override=7, max_num_batched_tokens=16)
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        sched = llm.engine_core.scheduler
        victims, preempt = [], sched._preempt
        sched._preempt = lambda victim, *a: victims.append(victim) or preempt(victim, *a)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        preemptions = len(victims)
        _check_slots(llm)
    finally:
        llm.shutdown()
    assert preemptions > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_next_turn_starts_from_a_checkpoint_of_the_last(qwen35):
    """An agent's turns: the second prompt repeats the first turn's prompt and answer and
    adds a tool's output. Its prefix hit ends on a checkpoint of the first turn's states
    (a whole number of blocks, past its prompt), and its tokens are transformers' for the
    whole second prompt; a third request that shares only the first prompt restores the
    prompt's checkpoint."""
    from vllm import LLM, SamplingParams

    path, hf = qwen35
    first = _prompts(3)[2]  # 41 tokens: its prompt's checkpoint at 32 (blocks of 16)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = LLM(model=str(path), kv_cache_memory="16MiB", max_num_batched_tokens=64)
    try:
        answer = list(llm.generate({"prompt_token_ids": first}, params)[0].outputs[0].token_ids)
        tool = _prompts(1, seed=9)[0]
        second = first + answer + tool
        out = llm.generate({"prompt_token_ids": second}, params)[0]
        third = first + tool
        out3 = llm.generate({"prompt_token_ids": third}, params)[0]
        checkpoints = llm.engine_core.scheduler.state_checkpoints
        restores = checkpoints.restores
        _check_slots(llm)
        llm.engine_core.scheduler.check_invariants()
    finally:
        llm.shutdown()
    # The first turn computed 41 + 29 = 70 tokens: its latest checkpoint at 64.
    assert out.num_cached_tokens == 64 and out3.num_cached_tokens == 32 and restores == 2
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, [second], 30)[0]
    assert list(out3.outputs[0].token_ids) == hf_greedy(hf, [third], 30)[0]


def test_a_draft_model_is_refused(qwen35):
    """Drafts from a draft model are not served for these models (n-gram and suffix
    drafts are: below; the model's own MTP layer's too: spec_decode/test_qwen3_next_mtp.py,
    which also checks the EAGLE methods' refusal)."""
    from vllm import LLM

    spec = {"method": "draft_model", "model": str(qwen35[0]), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="--speculative-config: method 'draft_model'"):
        LLM(model=str(qwen35[0]), speculative_config=spec)


def test_ssm_cache_dtype_sets_the_states_dtype(qwen35):
    """--mamba-ssm-cache-dtype: the recurrent state's pools in that dtype, the conv
    states in the model's."""
    from vllm import LLM

    llm = LLM(model=str(qwen35[0]), kv_cache_memory="16MiB", mamba_ssm_cache_dtype="bfloat16")
    try:
        pools = llm.engine_core.model_runner.recurrent_states
        assert len(pools) == 3
        assert all(p[1].dtype == torch.bfloat16 and p[0].dtype == torch.float32 for p in pools)
    finally:
        llm.shutdown()


def test_a_checkpoints_own_ssm_cache_dtype_is_the_default(qwen35):
    """A config naming ``mamba_ssm_cache_dtype`` (Nemotron-H's float32) sets the states'
    dtype under ``auto``, as vLLM; the flag set explicitly wins."""
    from vllm import LLM

    overrides = {"mamba_ssm_cache_dtype": "bfloat16"}
    for flag, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        llm = LLM(model=str(qwen35[0]), kv_cache_memory="16MiB", hf_overrides=overrides,
                  mamba_ssm_cache_dtype=flag)  # fmt: skip
        try:
            assert llm.engine_core.model_runner.recurrent_states[0][1].dtype == want, flag
        finally:
            llm.shutdown()


def test_a_hand_built_config_is_refused_after_loading(qwen35):
    """A VllmConfig built without EngineArgs meets the same refusal in the runner."""
    from vllm.config import CacheConfig, ModelConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.engine.core import EngineCore

    config = VllmConfig(
        model_config=ModelConfig(model=str(qwen35[0])),
        cache_config=CacheConfig(kv_cache_memory_bytes=1 << 24),
        speculative_config=SpeculativeConfig(
            speculative_config={
                "method": "draft_model",
                "model": str(qwen35[0]),
                "num_speculative_tokens": 2,
            }
        ),
    )
    with pytest.raises(ValueError, match="--speculative-config"):
        EngineCore(config)


def test_a_turn_offloaded_to_the_cpu_tier_comes_back_with_its_states(qwen35):
    """With the CPU KV tier: a job's first turn, then other requests that take every block
    of a small pool and every device checkpoint slot (two, as --max-num-seqs). The first
    turn's blocks go to the tier, its checkpoints to the tier's host slots; the next turn
    loads the blocks, restores the states from host memory, and keeps transformers'
    tokens. Without the tier the same next turn finds nothing."""
    check_offloaded_turn(*qwen35)


def check_offloaded_turn(path, hf, **kwargs) -> None:
    """The test above, with ``kwargs`` for ``LLM`` (the CUDA test's device and dtype)."""
    from vllm import LLM, SamplingParams

    first = _prompts(3)[2]  # 41 tokens
    others = [_prompts(1, seed=s)[0] * 12 for s in (20, 21, 22, 23)]  # 60 tokens each
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    hits = {}
    for tier in (0.01, 0):
        llm = LLM(model=str(path), num_gpu_blocks_override=9, max_num_seqs=2,
                  max_num_batched_tokens=64, kv_offloading_size=tier, **kwargs)  # fmt: skip
        try:
            out = llm.generate({"prompt_token_ids": first}, params)[0]
            second = first + list(out.outputs[0].token_ids) + _prompts(1, seed=9)[0]
            llm.generate([{"prompt_token_ids": p} for p in others], params)
            offloaded = llm.engine_core.scheduler.state_checkpoints.num_offloaded
            out2 = llm.generate({"prompt_token_ids": second}, params)[0]
            hits[tier] = out2.num_cached_tokens
            _check_slots(llm)
            llm.engine_core.scheduler.check_invariants()
        finally:
            llm.shutdown()
        assert list(out2.outputs[0].token_ids) == hf_greedy(hf, [second], 30)[0], tier
        assert (offloaded > 0) == bool(tier)
    assert hits[0] == 0 and hits[0.01] == 64  # the first turn's latest checkpoint (70 tokens)


def test_split_tier_keeps_the_devices_proportion():
    from vllm.model_executor.layers.recurrent import split_tier

    # The device: 100 blocks of 10 bytes and 4 slots of 250 bytes (half and half).
    assert split_tier(4000, 10, 250, 100, 4) == (200, 8)
    assert split_tier(600, 10, 250, 100, 4) == (35, 1)
    assert split_tier(400, 10, 250, 100, 4) == (0, 0)  # not a whole slot


def test_a_policy_that_keeps_contexts_gets_a_tier_with_state_slots(qwen35):
    """--scheduling-policy continuum sizes a CPU tier by itself: for a model with
    recurrent layers it holds checkpoint slots next to its blocks (ContextServe's offload
    of a slow tool's job has somewhere to put the states)."""
    from vllm import LLM

    llm = LLM(model=str(qwen35[0]), kv_cache_memory="16MiB", scheduling_policy="continuum")
    try:
        core = llm.engine_core
        assert core.num_cpu_blocks > 0 and core.num_host_state_slots > 0
        assert core.scheduler.state_checkpoints.num_host_slots == core.num_host_state_slots
        assert len(core.model_runner.host_checkpoints) == 3  # its Gated DeltaNet layers
    finally:
        llm.shutdown()


def test_drafts_are_verified_with_the_states_rolled_back(qwen35, monkeypatch):
    """Speculative decoding with model-free drafts (n-gram's, suffix decoding's): a step
    that verifies k drafts runs them a position at a time through the recurrent layers,
    and a request that keeps fewer gets its states after the tokens it kept back in its
    slot. The proposer drafts transformers' own continuation, wrong from a position that
    changes every call (``oracle_proposer``): greedy tokens must stay transformers' (with
    and without prefix caching, whose checkpoints no drafted step reaches)."""
    check_oracle_drafts(*qwen35, monkeypatch)


def check_oracle_drafts(path, hf, monkeypatch, **kwargs) -> None:
    """The test above, with ``kwargs`` for ``LLM`` (the CUDA test's device and dtype)."""
    from vllm import LLM, SamplingParams
    from vllm.v1.metrics.stats import SpecDecodingStats

    prompts = _prompts(3)
    expected = hf_greedy(hf, prompts, 40)
    propose = oracle_proposer([p + e for p, e in zip(prompts, expected, strict=True)])
    seen: list[tuple[int, int]] = []
    observe = SpecDecodingStats.observe
    monkeypatch.setattr(SpecDecodingStats, "observe",
                        lambda self, n, a: seen.append((n, a)) or observe(self, n, a))  # fmt: skip
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    for caching in (True, False):
        llm = LLM(model=str(path), kv_cache_memory="16MiB", speculative_config=spec,
                  enable_prefix_caching=caching, max_num_batched_tokens=32, **kwargs)  # fmt: skip
        try:
            monkeypatch.setattr(llm.engine_core.scheduler.proposer, "propose", propose)
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            _check_slots(llm)
            llm.engine_core.scheduler.check_invariants()
        finally:
            llm.shutdown()
        assert [list(o.outputs[0].token_ids) for o in outs] == expected, caching
    accepted = {a for n, a in seen if n == 3}
    assert accepted == {0, 1, 2, 3}, seen  # every way a step can end


def test_suffix_decoding_runs(qwen35):
    """The suffix proposer itself over these models: tokens as without it."""
    path, hf = qwen35
    prompts = _prompts(2)
    spec = {"method": "suffix", "num_speculative_tokens": 3}
    got, _ = _generate(path, prompts, 12, speculative_config=spec)
    assert got == hf_greedy(hf, prompts, 12)
