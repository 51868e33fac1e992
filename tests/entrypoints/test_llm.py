"""The offline LLM API on the embedded model (real weights, real tokens)."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind

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
    # fp32: compared with transformers token for token (the default is the gguf path).
    return LLM(
        num_gpu_blocks_override=64,
        max_num_batched_tokens=32,
        max_model_len=512,
        quantization="fp32",
    )


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


def test_prefix_cache_hit_changes_no_output(llm, hf_model, tokenizer):
    prompt = (
        "The history of the Roman Empire, from the founding of the city to the fall of "
        "Constantinople, is long and full of surprises. Its first emperor was"
    )
    first = llm.generate(prompt, greedy())[0]
    second = llm.generate(prompt, greedy())[0]
    assert first.num_cached_tokens == 0
    # Every full block of the prompt came from the cache (the last token is recomputed).
    assert second.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16 >= 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert first.outputs[0].token_ids == hf_greedy(hf_model, tokenizer, prompt, 16)


def generate_on_a_tiny_pool(params):
    """``PROMPTS`` on an engine whose pool forces preemptions: (outputs, the engine);
    11 usable blocks of 16 tokens for five requests of up to ~60 tokens each."""
    tiny = LLM(
        num_gpu_blocks_override=12,
        max_num_batched_tokens=64,
        max_model_len=512,
        quantization="fp32",
    )
    preemptions = []
    step = tiny.engine_core.step

    def counting_step():
        outputs = step()
        preemptions.append(outputs.scheduler_stats.num_preemptions)
        return outputs

    tiny.engine_core.step = counting_step
    outs = tiny.generate(PROMPTS, params)
    assert sum(preemptions) > 0
    return outs, tiny


def test_preemption_under_tiny_pool_gives_same_outputs(llm):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24))]
    outs, tiny = generate_on_a_tiny_pool(greedy(24))
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
    assert a.outputs[0].token_ids != a.outputs[1].token_ids  # seed + i per sample


def test_prompt_forms_params_per_prompt_and_order(llm, tokenizer):
    ids = tokenizer("1, 2, 3,").input_ids
    prompts = ["1, 2, 3,", ids, {"prompt_token_ids": ids}, {"prompt": "1, 2, 3,"}]
    params = [greedy(4), greedy(4), greedy(4), greedy(6, output_kind=RequestOutputKind.DELTA)]
    outs = llm.generate(prompts, params, use_tqdm=True)
    assert [o.prompt for o in outs] == ["1, 2, 3,", None, None, "1, 2, 3,"]
    assert all(o.prompt_token_ids == ids for o in outs)
    first = outs[0].outputs[0]
    assert all(o.outputs[0].token_ids == first.token_ids for o in outs[1:3])
    # The offline API returns whole results even when DELTA was asked for.
    assert outs[3].outputs[0].token_ids[:4] == first.token_ids
    assert outs[3].outputs[0].text.startswith(first.text) and len(first.text) > 0
    m = outs[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.num_generation_tokens == 4 and m.queue_time is not None
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(prompts, params[:2])


def test_chat_uses_the_template(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ended it
    assert out.outputs[0].stop_reason is None and "<|im_end|>" not in out.outputs[0].text
    assert out.prompt.endswith("<|im_start|>assistant\n")
    # A list of conversations: one output each, in order.
    other = [{"role": "user", "content": "Say hello."}]
    outs = llm.chat([question, other], SamplingParams(temperature=0, max_tokens=20))
    assert outs[0].outputs[0].text == out.outputs[0].text
    assert "Say hello." in outs[1].prompt


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
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(max_num_sequences=4)
    with pytest.raises(VLLMValidationError, match="text must be a string") as info:
        llm.chat([{"role": "user", "content": [{"type": "text", "text": 5}]}], greedy())
    assert info.value.param == "messages"
    with pytest.raises(VLLMValidationError, match="role"):
        llm.chat([{"content": "no role"}], greedy())
    # The engine is still healthy and holds nothing.
    assert llm.generate("1, 2,", greedy(2))[0].outputs[0].token_ids
    assert llm.engine_core.scheduler.kv_cache_manager.usage == 0.0


def test_max_tokens_past_max_model_len_is_a_cap_offline(llm):
    # 505 prompt tokens + 16 would pass max_model_len 512: offline (as in vLLM) the request
    # runs until the context is full instead of being rejected as the server rejects it.
    out = llm.generate([1000] * 505, greedy(16))[0].outputs[0]
    assert len(out.token_ids) == 512 - 505 and out.finish_reason == "length"


def _hf_log_softmax(hf_model, ids: list[int]):
    """(len(ids), vocab): row p is the distribution of the token after position p."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _assert_prompt_logprobs_match(lps, ids: list[int], ref, num_top: int) -> None:
    assert lps[0] is None and len(lps) == len(ids)  # the first token has no context
    for p in range(1, len(ids)):
        lp, row = lps[p], ref[p - 1]
        chosen = float(row[ids[p]])
        assert lp.token_id == ids[p] and lp.logprob == pytest.approx(chosen, abs=2e-3)
        # The rank, up to near-ties between fp32 implementations.
        assert (
            int((row > chosen + 2e-3).sum()) + 1 <= lp.rank <= int((row > chosen - 2e-3).sum()) + 1
        )
        assert [v for _, v in lp.top] == pytest.approx(row.topk(num_top).values.tolist(), abs=2e-3)
        for token_id, value in lp.top:
            assert value == pytest.approx(float(row[token_id]), abs=2e-3)


def test_prompt_logprobs_match_transformers_across_prefill_chunks(llm, hf_model):
    prompt = PROMPTS[2] + " " + PROMPTS[4]
    out = llm.generate(prompt, greedy(2, prompt_logprobs=3))[0]
    ids = out.prompt_token_ids
    assert len(ids) > 32  # more than one 32-token prefill chunk
    _assert_prompt_logprobs_match(out.prompt_logprobs, ids, _hf_log_softmax(hf_model, ids), 3)
    # As vLLM: a request with prompt logprobs computes its prompt, never a prefix hit...
    again = llm.generate(prompt, greedy(2, prompt_logprobs=3))[0]
    assert again.num_cached_tokens == 0
    first = [lp.logprob for lp in out.prompt_logprobs[1:]]
    assert [lp.logprob for lp in again.prompt_logprobs[1:]] == pytest.approx(first, abs=1e-5)
    # ...but the blocks it computed serve other requests.
    assert llm.generate(prompt, greedy(2))[0].num_cached_tokens >= 32
    assert llm.generate(prompt, greedy(2))[0].prompt_logprobs is None
    # n > 1: one list per request (the first sample computes it).
    params = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=2, prompt_logprobs=0)
    both = llm.generate(prompt, params)[0]
    assert len(both.outputs) == 2 and len(both.prompt_logprobs) == len(ids)
    assert all(lp.top == [] for lp in both.prompt_logprobs[1:])


def test_prompt_logprobs_survive_preemption_without_duplicates(llm):
    params = greedy(24, prompt_logprobs=1)
    expected = llm.generate(PROMPTS, params)
    outs, tiny = generate_on_a_tiny_pool(params)
    for out, ref in zip(outs, expected, strict=True):
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert [lp.token_id for lp in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
        got = [lp.logprob for lp in out.prompt_logprobs[1:]]
        assert got == pytest.approx([lp.logprob for lp in ref.prompt_logprobs[1:]], abs=1e-4)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    tiny.engine_core.scheduler.check_invariants()
    assert tiny.engine_core.scheduler.kv_cache_manager.usage == 0.0
