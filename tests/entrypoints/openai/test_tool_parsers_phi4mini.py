"""--tool-call-parser phi4_mini_json: Phi-4-mini's ``functools[{...}, ...]`` calls, whole
and streamed."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_qwen3coder_parser import assert_stream_assembles
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names

CALLS = (
    'functools[{"name": "get_weather", "arguments": {"city": "Paris", "tags": ["a]", "b"]}}, '
    '{"name": "bash", "parameters": {"command": "ls -la"}}]'
)
WANT = [
    ("get_weather", {"city": "Paris", "tags": ["a]", "b"]}),
    ("bash", {"command": "ls -la"}),
]


def extract(text: str, final: bool = True):
    out = get_tool_parser("phi4_mini_json").extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_name_is_offered():
    assert "phi4_mini_json" in tool_parser_names()


def test_calls_and_the_text_around_them():
    assert extract(CALLS) == (None, WANT)
    assert extract("Let me look.\n" + CALLS + "\nDone.") == ("Let me look.\n\nDone.", WANT)
    assert extract("functools [" + CALLS[len("functools[") :]) == (None, WANT)
    # The word in prose, then the calls.
    text = "I could use functools here. " + CALLS
    assert extract(text) == ("I could use functools here.", WANT)


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "import functools is a Python line.",
        "functools[]",
        CALLS[:50],  # cut off
        'functools[{"name": "f", "arguments": {"x": oops}}]',
        'functools[{"arguments": {}}]',
        'functools[{"name": "f", "arguments": "not an object"}]',
        "",
    ],
)
def test_anything_else_is_content_whole(text):
    assert extract(text) == (text or None, [])


@pytest.mark.parametrize(
    "text",
    [
        CALLS,
        "Let me look.\n" + CALLS + "\nDone.",
        "I could use functools here. " + CALLS,
        "import functools is a Python line.",
        "Almost functools",
    ],
)
def test_stream_assembles_to_the_message(text):
    plan = ToolPlan(parser=get_tool_parser("phi4_mini_json"))
    want = assert_stream_assembles(text, plan)
    assert bool(want) == ("[" in text)
