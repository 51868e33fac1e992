"""Processor: tokenization, chat template, length checks (the only ones), n>1 fan-out."""

from __future__ import annotations

import pytest

from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.processor import Processor


@pytest.fixture
def processor(tokenizer):
    config = EngineArgs(max_model_len=64).create_engine_config()
    return Processor(config, tokenizer, eos_token_id=2)


def test_text_and_token_id_prompts(processor, tokenizer):
    request_id, reqs = processor.process("Hello world", SamplingParams(), "r1")
    assert request_id == "r1" and [r.request_id for r in reqs] == ["r1"]
    assert reqs[0].prompt_token_ids == tokenizer("Hello world").input_ids
    assert reqs[0].eos_token_id == 2 and reqs[0].arrival_wall_time > 0
    _, reqs = processor.process([5, 6, 7], SamplingParams())
    assert reqs[0].prompt_token_ids == [5, 6, 7]


def test_too_long_prompt_is_rejected_not_truncated(processor):
    processor.process([1] * 63, SamplingParams(max_tokens=None))  # 63 + 1 generated: fit
    with pytest.raises(VLLMValidationError, match="max_model_len\\) is 64") as info:
        processor.process([1] * 64, SamplingParams(max_tokens=None))
    assert info.value.param == "prompt"
    with pytest.raises(ValueError, match="max_model_len"):
        processor.process("word " * 100, SamplingParams())
    with pytest.raises(VLLMValidationError, match="min_tokens") as info:
        processor.process([1] * 60, SamplingParams(max_tokens=None, min_tokens=10))
    assert info.value.param == "min_tokens"


def test_a_max_tokens_past_the_context_is_capped_at_what_is_left(processor):
    # As vLLM (get_max_tokens): not refused, capped; the output ends "length" there.
    params = SamplingParams(max_tokens=16)
    processor.process([1] * 48, params)  # 48 + 16 = 64: fits
    assert params.max_tokens == 16
    params = SamplingParams(max_tokens=32000, min_tokens=4)
    processor.process([1] * 49, params)
    assert params.max_tokens == 15


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ([], "empty"),
        ([1, -1], "token ids"),
        ([1, 10**9], "token ids"),
        ([1.5], "token ids"),
        ("a\ud800b", "Unicode"),  # a lone surrogate, as JSON's "\ud800" decodes
        (None, "prompt"),
    ],
)
def test_bad_prompts(processor, prompt, match):
    with pytest.raises(VLLMValidationError, match=match) as info:
        processor.process(prompt, SamplingParams())
    assert info.value.param == "prompt"


def test_bad_sampling_params(processor):
    with pytest.raises(ValueError, match="sampling_params"):
        processor.process("hi", {"temperature": 0})
    with pytest.raises(VLLMValidationError, match="stop_token_ids") as info:
        processor.process("hi", SamplingParams(stop_token_ids=[10**9]))
    assert info.value.param == "stop_token_ids"


def test_n_fans_out_with_per_child_seeds(processor):
    params = SamplingParams(n=3, seed=7, temperature=1.0)
    _, reqs = processor.process("Hi", params, "abc")
    assert [r.request_id for r in reqs] == ["0_abc", "1_abc", "2_abc"]
    assert [r.sampling_params.seed for r in reqs] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in reqs)
    assert params.n == 3 and params.seed == 7  # the caller's object is untouched
    _, reqs = processor.process("Hi", SamplingParams(n=2))
    assert [r.sampling_params.seed for r in reqs] == [None, None]


def test_chat_template(processor):
    text = processor.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    no_gen = processor.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], add_generation_prompt=False
    )
    assert not no_gen.endswith("assistant\n")
    custom = processor.apply_chat_template(
        [{"role": "user", "content": "Hi!"}],
        chat_template="{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}",
    )
    assert custom == "[user] Hi!"


def test_continue_final_message_leaves_the_last_message_open(processor):
    # vLLM's continue_final_message: the text stops inside the assistant turn the client
    # began, with no end-of-turn token, so the model goes on with it.
    messages = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! I am"},
    ]
    text = processor.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert text.endswith("<|im_start|>assistant\nHello! I am")
    closed = processor.apply_chat_template(messages, add_generation_prompt=False)
    assert closed.startswith(text) and closed[len(text) :].startswith("<|im_end|>")
    with pytest.raises(VLLMValidationError) as e:
        processor.apply_chat_template(messages, continue_final_message=True)
    assert e.value.param == "continue_final_message"


def test_logprobs_are_bounded_by_max_logprobs(tokenizer):
    # vLLM's --max-logprobs (20 by default); -1 in a request asks for the whole vocabulary,
    # which only a server started with --max-logprobs -1 gives.
    processor = Processor(EngineArgs(max_model_len=64).create_engine_config(), tokenizer, 2)
    processor.process([1, 2], SamplingParams(logprobs=20, prompt_logprobs=20))
    for name in ("logprobs", "prompt_logprobs"):
        for value in (21, -1):
            with pytest.raises(VLLMValidationError, match="--max-logprobs") as info:
                processor.process([1, 2], SamplingParams(**{name: value}))
            assert info.value.param == name
    config = EngineArgs(max_model_len=64, max_logprobs=-1).create_engine_config()
    unbounded = Processor(config, tokenizer, 2)
    params = SamplingParams(logprobs=-1, prompt_logprobs=100)
    _, reqs = unbounded.process([1, 2], params)
    assert reqs[0].sampling_params.logprobs == len(tokenizer)
    assert reqs[0].sampling_params.prompt_logprobs == 100
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-2)
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(max_logprobs=-2).create_engine_config()
