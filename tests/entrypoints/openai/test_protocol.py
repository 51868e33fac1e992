"""Request models: agent metadata in its three places, messages, sampling mapping, errors."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_messages,
)
from vllm.entrypoints.utils import check_chat_template, get_open_port
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def extra_args(req) -> dict | None:
    return req.to_sampling_params(max_tokens=8, logprobs=None, stream=False).extra_args


@pytest.mark.parametrize(
    "fields",
    [
        {"job_id": "job_alpha", "is_last_step": False},  # openai client extra_body
        {"vllm_xargs": {"job_id": "job_alpha", "is_last_step": False}},
        {"extra_body": {"job_id": "job_alpha", "is_last_step": False}},  # raw requests
    ],
)
def test_agent_metadata_reaches_extra_args_from_each_place(fields):
    params = chat(**fields).to_sampling_params(8, None, False)
    assert params.extra_args == {"job_id": "job_alpha", "is_last_step": False}
    assert params.job_id == "job_alpha" and params.is_last_step is False


def test_top_level_wins_and_other_xargs_pass_through():
    req = chat(
        job_id="top",
        vllm_xargs={"job_id": "xargs", "is_last_step": True, "tag": 3},
        extra_body={"job_id": "nested"},
    )
    assert extra_args(req) == {"job_id": "top", "is_last_step": True, "tag": 3}


def test_no_metadata_means_no_extra_args():
    assert extra_args(chat()) is None


def test_nested_extra_body_carries_sampling_fields_too():
    req = CompletionRequest.model_validate(
        {"prompt": "x", "max_tokens": 3, "extra_body": {"top_k": 5, "max_tokens": 99}}
    )
    assert req.top_k == 5 and req.max_tokens == 3  # the top level wins


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"job_id": 5}, "job_id"),
        ({"is_last_step": "no"}, "is_last_step"),
        ({"extra_body": {"is_last_step": 1}}, "is_last_step"),
        ({"vllm_xargs": {"job_id": ["x"]}}, "job_id"),
        ({"vllm_xargs": {"is_last_step": "yes"}}, "is_last_step"),
    ],
)
def test_wrong_metadata_types_fail_validation_naming_the_field(fields, name):
    # Wherever it was given, the value is checked once, as the top-level field.
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    assert info.value.errors()[0]["loc"] == (name,)


def test_job_id_resolved_once_on_the_model():
    req = chat(vllm_xargs={"job_id": "x", "tag": 1}, extra_body={"is_last_step": True})
    assert (req.job_id, req.is_last_step, req.vllm_xargs) == ("x", True, {"tag": 1})
    # A bad value that loses to the top level is never used, so never an error.
    assert chat(job_id="top", vllm_xargs={"job_id": 5}).job_id == "top"


def test_messages_validated_and_text_parts_joined():
    req = chat(
        messages=[
            {"role": "system", "content": None},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": "c", "name": "bot"},
        ]
    )
    assert [m.for_template() for m in req.messages] == [
        {"role": "system", "content": ""},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "c", "name": "bot"},
    ]


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"content": "no role"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        [{"role": "user", "content": [{"type": "text", "text": None}]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        ["hi"],
    ],
)
def test_bad_messages_name_the_field(messages):
    with pytest.raises(ValidationError) as info:
        chat(messages=messages)
    assert info.value.errors()[0]["loc"][0] == "messages"
    with pytest.raises(VLLMValidationError) as err:
        parse_messages(messages)
    assert err.value.param == "messages"


def test_sampling_mapping_and_output_kind():
    req = chat(temperature=0.5, top_p=0.9, top_k=4, seed=3, stop="END", n=2)
    params = req.to_sampling_params(max_tokens=12, logprobs=2, stream=True)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 4, 3)
    assert params.max_tokens == 12 and params.logprobs == 2 and params.n == 2
    assert params.output_kind == RequestOutputKind.DELTA
    assert chat().to_sampling_params(1, None, False).output_kind == RequestOutputKind.FINAL_ONLY


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": NAN}, "temperature"),
        ({"temperature": INF}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": NAN}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**63}, "top_k"),
        ({"min_p": NAN}, "min_p"),
        ({"presence_penalty": NAN}, "presence_penalty"),
        ({"frequency_penalty": -INF}, "frequency_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": INF}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 10**30}, "seed"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_sampling_values_name_the_field(fields, name):
    with pytest.raises(VLLMValidationError) as info:
        chat(**fields).to_sampling_params(8, None, False)
    assert info.value.param == name


def test_extreme_valid_sampling_values_pass():
    for fields in (
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"repetition_penalty": 0.01},
        {"temperature": 0.0, "top_k": -1},
        {"top_k": 2**63 - 1},
    ):
        chat(**fields).to_sampling_params(8, None, False)


def test_max_tokens_zero_is_refused_not_replaced():
    with pytest.raises(VLLMValidationError) as info:
        chat().to_sampling_params(0, None, False)
    assert info.value.param == "max_tokens"


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"vllm_xargs": _nested(900)}, "vllm_xargs"),
        ({"tools": [_nested(100)]}, "tools"),
        ({"extra_body": {"deep": _nested(65)}}, "deep"),
    ],
)
def test_deep_nesting_is_refused_naming_the_field(fields, name):
    chat(vllm_xargs={"x": _nested(60)}, tools=[_nested(60)], tool_choice="none")  # tens: fine
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, VLLMValidationError) and cause.param == name


def test_chat_template_path_check(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    check_chat_template(str(template))
    check_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")  # template text
    with pytest.raises(ValueError, match="chat_template"):
        check_chat_template(str(tmp_path / "missing.jinja"))


def test_get_open_port_is_bindable():
    import socket

    port = get_open_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_logit_bias_keys_become_token_ids_and_values_are_clamped_as_vllm():
    params = chat(logit_bias={"5": 2, "17": 250.0, "3": -1e9}).to_sampling_params(8, None, False)
    assert params.logit_bias == {5: 2.0, 17: 100.0, 3: -100.0}
    assert chat(allowed_token_ids=[4, 9]).to_sampling_params(8, None, False).allowed_token_ids == [
        4,
        9,
    ]
    for bad in ({"x": 1.0}, {"-3": 1.0}, {"2": float("nan")}):
        with pytest.raises(VLLMValidationError) as info:
            chat(logit_bias=bad).to_sampling_params(8, None, False)
        assert info.value.param == "logit_bias"
    with pytest.raises(VLLMValidationError) as info:
        chat(allowed_token_ids=[]).to_sampling_params(8, None, False)
    assert info.value.param == "allowed_token_ids"


# Qwen3-Coder's template walks a call's arguments as a mapping (`arguments|items`).
ITEMS_TEMPLATE = (
    "{%- for m in messages -%}{%- for c in m.tool_calls or [] -%}"
    "<function={{ c.function.name }}>{%- for k, v in c.function.arguments|items -%}"
    "<parameter={{ k }}>{{ v }}</parameter>{%- endfor -%}</function>"
    "{%- endfor -%}{%- endfor -%}"
)


def test_an_assistant_calls_arguments_reach_the_template_as_a_dict(tokenizer, caplog):
    def call(arguments):
        return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}

    raw = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"a": 1, "b": "x"}')]},
        {"role": "assistant", "tool_calls": [call("not json"), call("[1]"), call("")]},
    ]
    request = ChatCompletionRequest.model_validate({"messages": raw})
    rendered = [m.for_template() for m in request.messages]
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": "x"}
    assert [c["function"]["arguments"] for c in rendered[2]["tool_calls"]] == [{}, {}, {}]
    assert "not a JSON object" in caplog.text
    # The request itself keeps the client's strings.
    assert request.messages[1].model_extra["tool_calls"][0]["function"]["arguments"].startswith("{")
    text = tokenizer.apply_chat_template(rendered, chat_template=ITEMS_TEMPLATE, tokenize=False)
    assert text == "<function=f><parameter=a>1</parameter><parameter=b>x</parameter></function>" + (
        "<function=f></function>" * 3
    )
