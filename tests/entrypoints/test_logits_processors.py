"""allowed_token_ids, logit_bias and min_tokens through the offline API on a tiny random
model: what the sampler unit tests check row by row, here end to end, and the front end's
refusal of token ids outside the vocabulary (nothing reaches the engine)."""

from __future__ import annotations

import pytest

from tests.entrypoints.test_generation_config import tiny_model
from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError

PROMPT = {"prompt_token_ids": [5, 17, 300, 4000, 12]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    engine = LLM(model=tiny_model(tmp_path_factory.mktemp("tiny")), kv_cache_memory="16MiB")
    yield engine
    engine.shutdown()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, **kw)


def test_allowed_token_ids_and_logit_bias_steer_every_token(llm):
    free = llm.generate(PROMPT, greedy(ignore_eos=True))[0].outputs[0].token_ids
    allowed = [101, 202, 303]
    out = llm.generate(PROMPT, greedy(allowed_token_ids=allowed))[0].outputs[0].token_ids
    assert set(out) <= set(allowed) and len(out) == 6
    biased = llm.generate(PROMPT, greedy(logit_bias={777: 100.0}))[0].outputs[0].token_ids
    assert biased == [777] * 6 != free
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=20, allowed_token_ids=allowed)
    assert set(llm.generate(PROMPT, sampled)[0].outputs[0].token_ids) <= set(allowed)


def test_min_tokens_keeps_a_forced_stop_token_out_until_then(llm):
    # EOS (2) is the only token allowed besides 9: greedy takes EOS as soon as it may.
    params = greedy(allowed_token_ids=[2, 9], logit_bias={2: 100.0}, min_tokens=3)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert out.token_ids == [9, 9, 9, 2] and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "field, params",
    [
        ("logit_bias", {"logit_bias": {10**6: 1.0}}),
        ("allowed_token_ids", {"allowed_token_ids": [1, 10**6]}),
        ("stop_token_ids", {"stop_token_ids": [10**6]}),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_field(llm, field, params):
    with pytest.raises(VLLMValidationError) as info:
        llm.generate(PROMPT, greedy(**params))
    assert info.value.param == field and "outside the vocabulary" in str(info.value)
    assert llm.engine_core.scheduler.kv_cache_manager.usage == 0.0


def test_bad_words_keep_a_word_out_even_against_a_bias(llm):
    (word_ids,) = llm.processor.bad_words_token_ids(["sea"])[:1]
    assert len(word_ids) == 1  # " sea" may add its spaced variant; "sea" is one token
    forced = greedy(logit_bias={word_ids[0]: 100.0})
    assert llm.generate(PROMPT, forced)[0].outputs[0].token_ids == word_ids * 6
    banned = greedy(logit_bias={word_ids[0]: 100.0}, bad_words=["sea"])
    out = llm.generate(PROMPT, banned)[0].outputs[0].token_ids
    assert word_ids[0] not in out and len(out) == 6


def test_bad_words_token_ids_cover_the_spaced_variant(llm):
    tokenizer = llm.get_tokenizer()
    variants = llm.processor.bad_words_token_ids(["  ocean"])
    bare = tokenizer("ocean", add_special_tokens=False).input_ids
    spaced = tokenizer(" ocean", add_special_tokens=False).input_ids
    assert variants[0] == bare
    assert variants[1:] == ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    ids = list(range(100, 140))
    out = llm.generate({"prompt_token_ids": ids}, greedy(truncate_prompt_tokens=7))[0]
    assert out.prompt_token_ids == ids[-7:]
    with pytest.raises(VLLMValidationError) as info:
        llm.generate({"prompt_token_ids": ids}, greedy(truncate_prompt_tokens=10**6))
    assert info.value.param == "truncate_prompt_tokens"
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        greedy(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="bad_words"):
        greedy(bad_words=[" "])


def test_detokenize_false_returns_token_ids_without_text(llm):
    text = llm.generate(PROMPT, greedy(ignore_eos=True))[0].outputs[0]
    ids_only = llm.generate(PROMPT, greedy(ignore_eos=True, detokenize=False))[0].outputs[0]
    assert ids_only.token_ids == text.token_ids and ids_only.text == "" != text.text
    stop = text.token_ids[2]
    stopped = llm.generate(PROMPT, greedy(detokenize=False, stop_token_ids=[stop]))[0]
    assert stopped.outputs[0].token_ids[-1] == stop and stopped.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="stop strings need detokenize"):
        greedy(detokenize=False, stop=["x"])


def test_shutdown_gives_the_weights_and_the_kv_cache_back(tmp_path):
    """An LLM shut down drops its runner's weights, KV cache and graphs (on CUDA the
    device memory goes back too), so a second LLM in the process sizes its pool from
    memory that is really free; the outputs already returned stay readable."""
    engine = LLM(model=tiny_model(tmp_path), kv_cache_memory="16MiB")
    out = engine.generate(PROMPT, greedy(ignore_eos=True))
    runner = engine.engine_core.model_runner
    assert runner.kv_caches and runner.model is not None
    engine.shutdown()
    assert runner.kv_caches == [] and runner.model is None and runner.kv_offload is None
    assert len(out[0].outputs[0].token_ids) == 6
