"""--tool-call-parser kimi_k2 and --reasoning-parser kimi_k2: Kimi-K2's
``<|tool_calls_section_begin|>`` sections of ``functions.NAME:IDX`` calls (the header kept
as the call's id), whole and streamed, and its ``<think>`` reasoning."""

from __future__ import annotations

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

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
PARIS = '{"city": "Paris", "days": 3}'


def call(header: str, args: str) -> str:
    return f"{CALL_BEGIN}{header}{ARGS_BEGIN}{args}{CALL_END}"


def section(*calls: str, sep: str = "\n") -> str:
    """A section as Kimi-K2 writes one (a newline around each call)."""
    return SECTION_BEGIN + sep + sep.join(calls) + sep + SECTION_END


TWO = "Checking.\n" + section(
    call("functions.get_weather:0", PARIS), call("functions.get_time:1", "{}")
)


def extract(text: str, final: bool = True):
    out = get_tool_parser("kimi_k2").extract(text, final)
    return out.content, [(c.id, c.name, c.arguments) for c in out.calls if c.complete]


def test_names_are_offered():
    assert "kimi_k2" in tool_parser_names() and "kimi_k2" in reasoning_parser_names()
    assert tool_parser_class("kimi_k2").keeps_special_tokens  # Kimi's markers are special
    assert get_reasoning_parser("kimi_k2").keeps_special_tokens


def test_calls_ids_and_content():
    assert extract(TWO) == (
        "Checking.",
        [
            ("functions.get_weather:0", "get_weather", PARIS),
            ("functions.get_time:1", "get_time", "{}"),
        ],
    )


@pytest.mark.parametrize(
    ("header", "want"),
    [
        (" functions.get_weather:12 ", ("functions.get_weather:12", "get_weather")),
        ("get_weather:0", ("get_weather:0", "get_weather")),  # without the namespace
        ("functions.a.b:3", ("functions.a.b:3", "a.b")),
    ],
)
def test_the_header_is_the_id_and_names_the_function(header, want):
    assert extract(section(call(header, "{}")))[1] == [(*want, "{}")]


def test_empty_arguments_and_a_call_closed_by_the_section_end():
    assert extract(section(call("functions.f:0", "  ")))[1] == [("functions.f:0", "f", "{}")]
    text = SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGS_BEGIN + PARIS + SECTION_END
    assert extract(text) == (None, [("functions.f:0", "f", PARIS)])


def test_text_after_the_section_is_content():
    # vLLM drops it; here nothing the model wrote is lost.
    assert extract(section(call("functions.f:0", "{}")) + " Done.")[0] == "Done."


@pytest.mark.parametrize(
    "bad",
    [
        section(call("functions.get_weather", "{}")),  # no :IDX
        section(call(":0", "{}")),  # no name
        section(call("functions.f:0", "[1]")),  # not an object
        section(call("functions.f:0", '{"a": 1')),  # not closed before the end tag
        section(call("functions.f:0", '{"a": 1} trailing')),
        SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGS_BEGIN + '{"a": "cut',
        SECTION_BEGIN + CALL_BEGIN + "functions.f",  # cut in the header
        SECTION_BEGIN + "\n",  # cut after the section opens
        SECTION_BEGIN + SECTION_END,  # an empty section
    ],
)
def test_malformed_or_cut_calls_are_content(bad):
    assert extract("Before. " + bad) == (("Before. " + bad).strip(), [])
    message, finish = ToolPlan(parser=get_tool_parser("kimi_k2")).message(bad, "length")
    assert message == {"role": "assistant", "content": bad} and finish == "length"


def test_a_bad_call_next_to_good_ones():
    bad = call("functions.f", "{}")
    text = section(call("functions.a:0", "{}"), bad, call("functions.b:1", "{}"))
    content, calls = extract(text)
    assert content == bad and [c[1] for c in calls] == ["a", "b"]


def test_every_cut_point_is_safe_and_only_grows():
    parser = get_tool_parser("kimi_k2")
    assert_readings_only_grow(parser, TWO + " Done.")
    assert_readings_only_grow(parser, SECTION_BEGIN + call("functions.f:0", '{"a": [1, {"b"'))


def test_streamed_call_shows_with_its_header_and_id():
    head = TWO[: TWO.index(ARGS_BEGIN)]
    assert get_tool_parser("kimi_k2").extract(head, final=False).calls == []
    out = get_tool_parser("kimi_k2").extract(head + ARGS_BEGIN + '{"ci', final=False)
    [first] = out.calls
    assert (first.id, first.name, first.arguments) == (
        "functions.get_weather:0",
        "get_weather",
        '{"ci',
    )


@pytest.mark.parametrize(
    "text",
    [
        TWO,
        TWO + " and after",
        section(call("functions.f:0", "{}"), call("functions.g", "{}")),  # one bad
        "No call: <|tool and <|tool_calls_section are text.",
        "<think>Which city?  \n</think>\n" + TWO,
        "Weather needed." + section(call("functions.get_weather:0", PARIS)),
        "Thinking still, cut off  \n",
    ],
)
def test_stream_assembles_to_the_message(text):
    plan = ToolPlan(parser=get_tool_parser("kimi_k2"), reasoning=get_reasoning_parser("kimi_k2"))
    assert_stream_assembles(text, plan)


def test_reasoning_split():
    parser = get_reasoning_parser("kimi_k2")
    out = parser.extract("<think>Plan it. \n</think>\n\nAnswer", final=True)
    assert (out.reasoning, out.content, out.ended) == ("Plan it.", "Answer", True)
    # The output starts inside the reasoning; never ended: all reasoning, no content.
    out = parser.extract("Still thinking \n", final=True)
    assert (out.reasoning, out.content, out.ended) == ("Still thinking", "", False)
    # Streamed, trailing whitespace waits for what follows.
    assert parser.extract("Plan \n", final=False).reasoning == "Plan"
    assert parser.extract("Plan \nmore", final=False).reasoning == "Plan \nmore"
    # A tool section inside the reasoning ends it and stays content for the tool parser.
    out = parser.extract("Need weather.\n" + TWO.split("\n", 1)[1], final=True)
    assert out.reasoning == "Need weather." and out.content.startswith(SECTION_BEGIN)
    assert out.ended and parser.end_of_reasoning == "</think>"


@pytest.mark.parametrize(
    ("kwargs", "thinks"),
    [
        ({}, True),
        ({"thinking": False}, False),
        ({"enable_thinking": False}, False),
        ({"thinking": False, "enable_thinking": True}, True),
        ({"thinking": True}, True),
    ],
)
def test_reasoning_switch(kwargs, thinks):
    parser = get_reasoning_parser("kimi_k2", kwargs)
    out = parser.extract("<think>x</think>y", final=True)
    assert (out.reasoning is not None) == thinks
    if not thinks:
        assert out.content == "<think>x</think>y" and parser.end_of_reasoning is None


# -- end to end through the chat endpoint, over test_harmony's scripted engine ----------
KIMI_MARKERS = [SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, ARGS_BEGIN]
KIMI_MARKERS += ["<think>", "</think>"]


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory):
    """The embedded tokenizer with Kimi's markers as special tokens, as Kimi's are."""
    import shutil

    from transformers import AutoTokenizer

    from vllm.config import DEFAULT_MODEL
    from vllm.model_executor.model_loader import resolve_model

    folder = tmp_path_factory.mktemp("kimi_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{resolve_model(DEFAULT_MODEL)}/{name}", folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": KIMI_MARKERS})
    return tokenizer


@pytest.mark.parametrize("stream", [False, True])
def test_chat_endpoint_keeps_kimis_call_ids(kimi_tokenizer, stream):
    from tests.entrypoints.openai.test_harmony import serve
    from vllm.entrypoints.openai.tool_calling import ToolCallingConfig

    config = ToolCallingConfig(
        enable_auto_tool_choice=True, tool_call_parser="kimi_k2", reasoning_parser="kimi_k2"
    )
    text = "Paris.</think>" + section(call("functions.get_weather:0", PARIS))
    weather = {"name": "get_weather", "parameters": {"type": "object"}}
    body = {"tools": [{"type": "function", "function": weather}], "stream": stream}
    out, seen = serve(kimi_tokenizer, None, text, body, config=config)
    assert seen["params"].skip_special_tokens is False  # the markers reach the parser
    if stream:
        deltas = [e["choices"][0]["delta"] for e in out if e["choices"]]
        pieces = [p for d in deltas for p in d.get("tool_calls", [])]
        assert pieces[0]["id"] == "functions.get_weather:0"
        assert pieces[0]["function"]["name"] == "get_weather"
        assert "".join(p["function"]["arguments"] for p in pieces) == PARIS
        assert "".join(d.get("reasoning", "") for d in deltas) == "Paris."
        assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        choice = out["choices"][0]
        [tool_call] = choice["message"]["tool_calls"]
        assert tool_call["id"] == "functions.get_weather:0"
        assert tool_call["function"] == {"name": "get_weather", "arguments": PARIS}
        assert choice["message"]["reasoning"] == "Paris."
        assert choice["message"]["content"] is None and choice["finish_reason"] == "tool_calls"
