"""The offline LLM API on the embedded model (real weights, real tokens)."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams

from ..conftest import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away, there lived a young girl who loved to",
    "1, 2, 3,",
    "Here is a list of the ten most popular programming languages in 2024, with a "
    "short explanation of what each one is used for and why developers like it:\n1.",
]


@pytest.fixture(scope="module")
def llm():
    # Small pool and step budget: chunked prefill and a real block pool are exercised.
    return LLM(num_gpu_blocks_override=64, max_num_batched_tokens=32, max_model_len=512)


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_matches_transformers_generate(llm, hf_model, tokenizer):
    outs = llm.generate(PROMPTS, greedy())
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, tokenizer, prompt, 16), prompt
        assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids)
    sched = llm.engine_core.scheduler
    sched.check_invariants()
    assert sched.kv_cache_manager.usage == 0.0


def test_prefix_cache_hit_changes_no_output(llm):
    first = llm.generate(PROMPTS[4], greedy())[0]
    second = llm.generate(PROMPTS[4], greedy())[0]
    assert second.num_cached_tokens >= 16  # the prompt's full blocks came from the cache
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_under_tiny_pool_gives_same_outputs(llm):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24))]
    tiny = LLM(num_gpu_blocks_override=12, max_num_batched_tokens=64, max_model_len=512)
    outs = tiny.generate(PROMPTS, greedy(24))
    assert [o.outputs[0].token_ids for o in outs] == expected
    tiny.engine_core.scheduler.check_invariants()
    assert tiny.engine_core.scheduler.kv_cache_manager.usage == 0.0


def test_stop_strings_n_and_seeds(llm):
    out = llm.generate("1, 2, 3, 4,", greedy(20, stop=[" 7"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 7"
    assert out.text.endswith("6,") and " 7" not in out.text
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3, ignore_eos=True)
    a = llm.generate("Tell me a story", params)[0]
    b = llm.generate("Tell me a story", params)[0]
    assert len(a.outputs) == 2 and [c.index for c in a.outputs] == [0, 1]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded


def test_chat_uses_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=20),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ended it


def test_logprobs(llm):
    out = llm.generate("The capital of France is", greedy(3, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 3
    for lp in out.logprobs:
        assert lp.rank == 1 and len(lp.top) == 2 and lp.top[0][0] == lp.token_id
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_bad_input_is_rejected_and_loses_nothing(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("word " * 600, greedy())
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], greedy())
    # The engine is still healthy and holds nothing.
    assert llm.generate("1, 2,", greedy(2))[0].outputs[0].token_ids
    assert llm.engine_core.scheduler.kv_cache_manager.usage == 0.0
