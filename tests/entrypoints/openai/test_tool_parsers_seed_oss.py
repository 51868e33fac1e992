"""--tool-call-parser seed_oss and --reasoning-parser seed_oss: Seed-OSS's
``<seed:tool_call><function=NAME><parameter=KEY>...`` calls (Qwen3-Coder's XML in Seed's
wrapper), typed by the request's tool schemas, whole and streamed, and its
``<seed:think>`` reasoning."""

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
FUNCTIONS = {"get_weather": WEATHER}


def seed(name: str, **params: str) -> str:
    """A call as Seed-OSS's template writes one."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<seed:tool_call>\n<function={name}>\n{body}</function>\n</seed:tool_call>"


CALL = seed("get_weather", city="New York", days="3", detailed="true", units='{"t": "C"}')
TWO = "Let me check.\n" + CALL + "\n" + seed("get_weather", city="Paris")


def extract(text: str, final: bool = True, functions=FUNCTIONS):
    out = get_tool_parser("seed_oss", functions).extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_names_are_offered():
    assert "seed_oss" in tool_parser_names() and "seed_oss" in reasoning_parser_names()
    assert tool_parser_class("seed_oss").keeps_special_tokens  # Seed's markers are special
    assert get_reasoning_parser("seed_oss").keeps_special_tokens


def test_calls_content_and_types():
    assert extract(TWO) == (
        "Let me check.",
        [
            ("get_weather", {"city": "New York", "days": 3, "detailed": True, "units": {"t": "C"}}),
            ("get_weather", {"city": "Paris"}),
        ],
    )
    # Without the request's schema every value stays a string.
    assert extract(seed("f", n="5"), functions=None) == (None, [("f", {"n": "5"})])


def test_qwen3_wrapper_is_not_seeds_but_a_bare_function_is_a_call():
    qwen = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
    # The <function=...> inside is read (vLLM's fallback), the foreign wrapper stays text.
    assert extract(qwen) == ("<tool_call>\n\n</tool_call>", [("f", {})])
    assert extract("<function=f>\n</function>") == (None, [("f", {})])
    # Qwen3-Coder's parser does not read Seed's wrapper either.
    out = get_tool_parser("qwen3_coder").extract(CALL, final=True)
    assert out.content.startswith("<seed:tool_call>")


@pytest.mark.parametrize(
    "bad",
    [
        "<seed:tool_call>\nhello\n</seed:tool_call>",
        "<seed:tool_call>\n<function=f>\nstray\n</function>\n</seed:tool_call>",
        "<seed:tool_call>\n<function=f>\n<parameter=city>\nPar",  # cut inside a value
        "<seed:tool_call>\n<function=get_wea",  # cut inside the name
        "<seed:tool_call>",
    ],
)
def test_malformed_or_cut_calls_are_content(bad):
    assert extract("Before. " + bad) == ("Before. " + bad, [])
    message, _ = ToolPlan(parser=get_tool_parser("seed_oss", FUNCTIONS)).message(bad, "length")
    assert message == {"role": "assistant", "content": bad}


def test_every_cut_point_is_safe_and_only_grows():
    assert_readings_only_grow(get_tool_parser("seed_oss", FUNCTIONS), TWO + "\nDone.")


@pytest.mark.parametrize(
    "text",
    [
        CALL,
        TWO,
        TWO + "\nand after",
        "No call: <seed:tool and <seed:tool_call are text.",
        "<seed:think>Which city?</seed:think>\n" + CALL,
        "The user wants Paris.</seed:think>" + seed("get_weather", city="Paris"),
        "Thinking, then a call right away" + seed("get_weather", city="Paris"),
        "<seed:think>Never ends",
    ],
)
def test_stream_assembles_to_the_message(text):
    reasoning = get_reasoning_parser("seed_oss") if "think" in text.lower() else None
    plan = ToolPlan(parser=get_tool_parser("seed_oss", FUNCTIONS), reasoning=reasoning)
    assert_stream_assembles(text, plan)


def test_reasoning_split():
    parser = get_reasoning_parser("seed_oss")
    out = parser.extract("<seed:think>Plan it.</seed:think>\nAnswer", final=True)
    assert (out.reasoning, out.content, out.ended) == ("Plan it.", "Answer", True)
    assert parser.end_of_reasoning == "</seed:think>"
    # Without its start tag, and cut before the end: all reasoning, no content.
    out = parser.extract("Still thinking", final=True)
    assert (out.reasoning, out.content, out.ended) == ("Still thinking", "", False)
    # Streamed, a possible start of either tag waits.
    assert parser.extract("<seed:thi", final=False).reasoning == ""
    assert parser.extract("Plan</seed:th", final=False).reasoning == "Plan"
    # A call inside the reasoning ends it and is content for the tool parser.
    out = parser.extract("Need weather." + CALL, final=True)
    assert (out.reasoning, out.content, out.ended) == ("Need weather.", CALL, True)
    # Qwen3's tags are plain text here.
    assert parser.extract("<think>a</think>b", final=True).reasoning == "<think>a</think>b"


def test_reasoning_switch():
    off = get_reasoning_parser("seed_oss", {"enable_thinking": False})
    out = off.extract("<seed:think>x</seed:think>y", final=True)
    assert (out.reasoning, out.content) == (None, "<seed:think>x</seed:think>y")
    assert off.end_of_reasoning is None
    on = get_reasoning_parser("seed_oss", {"enable_thinking": True, "thinking_budget": 0})
    assert on.extract("<seed:think>x</seed:think>y", final=True).reasoning == "x"
