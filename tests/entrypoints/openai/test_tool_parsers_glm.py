"""--tool-call-parser glm45 / glm47 and --reasoning-parser glm45 / glm47: GLM-4.5-4.7's
``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`` calls, typed
by the request's tool schemas, whole and streamed."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_qwen3coder_parser import (
    assert_readings_only_grow,
    assert_stream_assembles,
)
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.entrypoints.openai.tool_parsers import (
    get_tool_parser,
    tool_parser_class,
    tool_parser_names,
)
from vllm.reasoning import get_reasoning_parser, reasoning_parser_names

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "detailed": {"type": "boolean"},
            "units": {"type": "object"},
        },
    },
}
FUNCTIONS = {"get_weather": WEATHER, "get_time": {"name": "get_time", "parameters": {}}}


def glm45(name: str, **args: str) -> str:
    """A call as GLM-4.5's template writes one (a newline after the name and each tag)."""
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


def glm47(name: str, **args: str) -> str:
    """GLM-4.7's: no newlines."""
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in args.items())
    return f"<tool_call>{name}{body}</tool_call>"


CALL = glm45("get_weather", city="New York\nNY", days="3", detailed="true")
TWO = "Let me check both.\n" + CALL + "\n" + glm47("get_weather", city="Paris") + "\nDone."


def extract(text: str, final: bool = True, functions=FUNCTIONS, name: str = "glm45"):
    out = get_tool_parser(name, functions).extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_names_are_offered():
    assert {"glm45", "glm47"} <= set(tool_parser_names())
    assert {"glm45", "glm47"} <= set(reasoning_parser_names())
    assert tool_parser_class("glm45") is tool_parser_class("glm47")
    assert tool_parser_class("glm45").keeps_special_tokens  # GLM's markers are special


@pytest.mark.parametrize("name", ["glm45", "glm47"])
def test_calls_content_and_types(name):
    content, calls = extract(TWO, name=name)
    assert content == "Let me check both.\n\n\nDone."
    assert calls == [
        ("get_weather", {"city": "New York\nNY", "days": 3, "detailed": True}),
        ("get_weather", {"city": "Paris"}),
    ]


def test_values_verbatim_keys_stripped_and_typed():
    text = glm47("get_weather", city=" Paris ", days=" 5 ", units='{"t": "C"}')
    text = text.replace("<arg_key>days", "<arg_key> days ")
    assert extract(text)[1] == [
        ("get_weather", {"city": " Paris ", "days": 5, "units": {"t": "C"}})
    ]
    # A value its type cannot hold stays a string; an unknown parameter too.
    text = glm47("get_weather", days="soon", extra="7")
    assert extract(text)[1] == [("get_weather", {"days": "soon", "extra": "7"})]


def test_without_tools_every_value_is_a_string():
    assert extract(glm47("anything", n="5"), functions=None) == (None, [("anything", {"n": "5"})])


def test_a_call_without_arguments():
    assert extract("<tool_call>get_time</tool_call>") == (None, [("get_time", {})])
    assert extract("<tool_call>get_time\n</tool_call>") == (None, [("get_time", {})])


def test_a_key_twice_keeps_the_first():
    text = glm47("get_weather", city="a").replace(
        "</tool_call>", "<arg_key>city</arg_key><arg_value>b</arg_value></tool_call>"
    )
    assert extract(text)[1] == [("get_weather", {"city": "a"})]


@pytest.mark.parametrize(
    "bad",
    [
        glm47("not_a_tool", x="1"),  # the request has tools, and this is none of them
        "<tool_call>get_weather\nstray<arg_key>city</arg_key><arg_value>P</arg_value></tool_call>",
        "<tool_call>get_weather<arg_key>city</arg_key>\n</tool_call>",  # key, no value
        "<tool_call><arg_key>city</arg_key><arg_value>P</arg_value></tool_call>",  # no name
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",  # cut in a value
        "<tool_call>get_wea",  # cut in the name
    ],
)
def test_malformed_or_cut_calls_are_content(bad):
    assert extract(bad) == (bad, [])
    message, finish = ToolPlan(parser=get_tool_parser("glm45", FUNCTIONS)).message(bad, "stop")
    assert message == {"role": "assistant", "content": bad} and finish == "stop"


def test_a_bad_call_next_to_a_good_one():
    bad = glm47("not_a_tool")
    assert extract(CALL + bad) == (bad, [extract(CALL)[1][0]])


def test_cut_after_a_whole_value_is_a_call():
    cut = CALL[: CALL.index("</arg_value>") + len("</arg_value>")]
    assert extract(cut)[1] == [("get_weather", {"city": "New York\nNY"})]


def test_every_cut_point_is_safe_and_only_grows():
    parser = get_tool_parser("glm45", FUNCTIONS)
    assert_readings_only_grow(parser, TWO)


@pytest.mark.parametrize(
    "text",
    [
        CALL,
        TWO,
        "<tool_call>get_time</tool_call>",
        "No call: a < b, <tool and <tool_call is text.",
        glm47("not_a_tool", x="1") + " then text",
        "<think>Which city?</think>\n" + CALL,
        "The user wants Paris.</think>" + glm47("get_weather", city="Paris"),
        "Thinking, then a call right away" + glm47("get_weather", city="Paris"),
    ],
)
def test_stream_assembles_to_the_message(text):
    reasoning = get_reasoning_parser("glm45") if "think" in text.lower() else None
    plan = ToolPlan(parser=get_tool_parser("glm45", FUNCTIONS), reasoning=reasoning)
    assert_stream_assembles(text, plan)


def test_reasoning_split_and_switch():
    parser = get_reasoning_parser("glm45")
    out = parser.extract("<think>Plan it.</think>\nAnswer", final=True)
    assert (out.reasoning, out.content, out.ended) == ("Plan it.", "Answer", True)
    # The template opens the block: no <think> in the output; cut before the end: reasoning.
    assert parser.extract("Still thinking", final=True).reasoning == "Still thinking"
    # A call inside the reasoning ends it and stays content for the tool parser.
    out = parser.extract("Need weather." + glm47("get_weather", city="P"), final=True)
    assert out.reasoning == "Need weather." and out.content.startswith("<tool_call>")
    for kwargs in ({"enable_thinking": False}, {"thinking": False}):
        off = get_reasoning_parser("glm45", kwargs)
        assert off.extract("<think>x</think>y", final=True).reasoning is None
        assert off.end_of_reasoning is None
    on = get_reasoning_parser("glm47", {"thinking": False, "enable_thinking": True})
    assert on.end_of_reasoning == "</think>"


# -- end to end through the chat endpoint, over test_harmony's scripted engine ----------
GLM_MARKERS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>"]
GLM_MARKERS += ["</arg_value>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def glm_tokenizer(tmp_path_factory):
    """The embedded tokenizer with GLM's markers as special tokens, as GLM's are."""
    import shutil

    from transformers import AutoTokenizer

    from vllm.config import DEFAULT_MODEL
    from vllm.model_executor.model_loader import resolve_model

    folder = tmp_path_factory.mktemp("glm_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{resolve_model(DEFAULT_MODEL)}/{name}", folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": GLM_MARKERS})
    return tokenizer


@pytest.mark.parametrize("stream", [False, True])
def test_chat_endpoint_reads_glm_reasoning_and_calls(glm_tokenizer, stream):
    from tests.entrypoints.openai.test_harmony import serve
    from vllm.entrypoints.openai.tool_calling import ToolCallingConfig

    config = ToolCallingConfig(
        enable_auto_tool_choice=True, tool_call_parser="glm47", reasoning_parser="glm47"
    )
    text = "Paris, three days.</think>" + glm47("get_weather", city="Paris", days="3")
    body = {"tools": [{"type": "function", "function": WEATHER}], "stream": stream}
    out, seen = serve(glm_tokenizer, None, text, body, config=config)
    assert seen["params"].skip_special_tokens is False  # the markers reach the parser
    want = {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}
    if stream:
        deltas = [e["choices"][0]["delta"] for e in out if e["choices"]]
        pieces = [p for d in deltas for p in d.get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "get_weather"
        assert "".join(p["function"]["arguments"] for p in pieces) == want["arguments"]
        assert "".join(d.get("reasoning", "") for d in deltas) == "Paris, three days."
        assert not "".join(d.get("content") or "" for d in deltas)
        assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        choice = out["choices"][0]
        assert choice["message"]["tool_calls"][0]["function"] == want
        assert choice["message"]["reasoning"] == "Paris, three days."
        assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
