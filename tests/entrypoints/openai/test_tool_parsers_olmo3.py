"""--tool-call-parser olmo3 and --reasoning-parser olmo3: OLMo 3's pythonic calls, one a
line in a ``<function_calls>`` block, whole and streamed."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_qwen3coder_parser import (
    _assemble,
    assert_readings_only_grow,
    assert_stream_assembles,
)
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from vllm.reasoning import get_reasoning_parser, reasoning_parser_names

LINES = "get_weather(city=\"Paris\", days=3, detailed=true, units=null)\nbash(command='ls -la')"
BLOCK = f"<function_calls>\n{LINES}\n</function_calls>"
WANT = [
    ("get_weather", {"city": "Paris", "days": 3, "detailed": True, "units": None}),
    ("bash", {"command": "ls -la"}),
]


def extract(text: str, final: bool = True):
    out = get_tool_parser("olmo3").extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_names_are_offered():
    assert "olmo3" in tool_parser_names() and "olmo3" in reasoning_parser_names()


def test_a_block_of_calls():
    assert extract(BLOCK) == (None, WANT)
    assert extract("I will check.\n" + BLOCK + "\nDone.") == ("I will check.\n\nDone.", WANT)
    nested = '<function_calls>f(a={"k": [1, 2.5, false]}, b=-1, c="x, y")</function_calls>'
    assert extract(nested) == (None, [("f", {"a": {"k": [1, 2.5, False]}, "b": -1, "c": "x, y"})])


def test_lines_without_the_block_are_calls_too():
    assert extract(LINES) == (None, WANT)
    assert extract("\n" + LINES + "\n\n") == (None, WANT)


def test_a_block_cut_between_lines_keeps_its_calls():
    assert extract("<function_calls>\n" + LINES + "\n") == (None, WANT)


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        "print(x) is how Python prints.",
        "<function_calls>\nget_weather(city='Par",  # cut inside a call
        "<function_calls>\nnot a call\n</function_calls>",
        "<function_calls>\n</function_calls>",
        "<function_calls>f(1)</function_calls>",  # positional arguments
        "<function_calls>f(a=x)</function_calls>",  # not a literal
        LINES + "\nand some words",
        "",
    ],
)
def test_anything_else_is_content_whole(text):
    assert extract(text) == (text or None, [])


def test_every_cut_point_is_safe_and_only_grows():
    parser = get_tool_parser("olmo3")
    text = "I will check.\n" + BLOCK + "\nDone."
    assert_readings_only_grow(parser, text)


@pytest.mark.parametrize(
    "text",
    [
        BLOCK,
        "I will check.\n" + BLOCK + "\nDone.",
        LINES,
        "Plain text, no calls < here.",
        "<think>Which city?</think>\n" + BLOCK,
        "Paris, so get_weather.</think>" + BLOCK,
    ],
)
def test_stream_assembles_to_the_message(text):
    reasoning = get_reasoning_parser("olmo3") if "think>" in text else None
    plan = ToolPlan(parser=get_tool_parser("olmo3"), reasoning=reasoning)
    want = assert_stream_assembles(text, plan)
    assert want or "no calls" in text


def test_prose_that_opens_like_a_call_is_never_streamed_as_one():
    plan = ToolPlan(parser=get_tool_parser("olmo3"))
    text = "print(x) is how Python prints.\nThat is all."
    assert _assemble(text, list(text), plan) == {"content": text, "reasoning": "", "calls": {}}


def test_reasoning():
    parser = get_reasoning_parser("olmo3")
    out = parser.extract("<think>Hmm.</think>\n\nAnswer", final=True)
    assert (out.reasoning, out.content, out.ended) == ("Hmm.", "Answer", True)
    out = parser.extract("Opened by the template.</think>Answer", final=True)
    assert (out.reasoning, out.content) == ("Opened by the template.", "Answer")
    assert parser.extract("cut off", final=True).content == ""
