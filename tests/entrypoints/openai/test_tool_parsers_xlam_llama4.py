"""--tool-call-parser xlam (xLAM's JSON list of calls, bare or in a block) and Llama 4's
``llama4_pythonic`` / ``llama4_json``: whole and streamed."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_qwen3coder_parser import (
    assert_readings_only_grow,
    assert_stream_assembles,
)
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names

LIST = (
    '[{"name": "get_weather", "arguments": {"city": "Paris", "tags": ["a]", "```"]}}, '
    '{"name": "bash", "arguments": {"command": "ls -la"}}]'
)
WANT = [
    ("get_weather", {"city": "Paris", "tags": ["a]", "```"]}),
    ("bash", {"command": "ls -la"}),
]


def extract(parser: str, text: str, final: bool = True):
    out = get_tool_parser(parser).extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_the_names_are_offered():
    assert {"xlam", "llama4_pythonic", "llama4_json"} <= set(tool_parser_names())


@pytest.mark.parametrize(
    "text, content",
    [
        (LIST, None),
        (f"I'll check both.\n```json\n{LIST}\n```\nDone.", "I'll check both.\n\nDone."),
        (f"```\n{LIST}\n```", None),
        (f"Sure. <tool_call>{LIST}</tool_call>", "Sure."),
        (f"Sure. [TOOL_CALLS]{LIST}\nAnything else?", "Sure. \nAnything else?"),
        (f"```json\n{LIST}", None),  # a fence left open at the end
        # A fence of code is content; the list's block after it is read.
        (f"Run:\n```python\nprint(1)\n```\n<tool_call>{LIST}</tool_call>",
         "Run:\n```python\nprint(1)\n```"),
    ],
)  # fmt: skip
def test_xlam_reads_the_list_bare_or_in_its_block(text, content):
    assert extract("xlam", text) == (content, WANT)


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "Here is code:\n```python\nprint([1, 2])\n```",
        '```json\n[{"name": "f", "arguments": {"x": oops}}]\n```',
        '```json\n[{"name": "f", "arguments": {}}] trailing\n```',
        "```json\n[]\n```",
        '[{"name": "f", "arguments": {}}] and more',
        LIST[:60],
        "",
    ],
)
def test_xlam_anything_else_is_content_whole(text):
    assert extract("xlam", text) == (text.strip() or None, [])


@pytest.mark.parametrize(
    "text",
    [
        LIST,
        f"I'll check both.\n```json\n{LIST}\n```\nDone.",
        f"Sure. <tool_call>{LIST}</tool_call>",
        "Here is code:\n```python\nprint([1, 2])\n```\nThat's it.",
        "Plain text with a [bracket] and `code`.",
    ],
)
def test_xlam_streams_to_the_message(text):
    parser = get_tool_parser("xlam")
    assert_readings_only_grow(parser, text)
    want = assert_stream_assembles(text, ToolPlan(parser=parser))
    assert bool(want) == ('"name"' in text)


PYTHONIC = '[get_weather(city="Tokyo", days=3), bash(command="ls")]'
PY_WANT = [("get_weather", {"city": "Tokyo", "days": 3}), ("bash", {"command": "ls"})]


@pytest.mark.parametrize(
    "text",
    [PYTHONIC, f"<|python_start|>{PYTHONIC}<|python_end|>", f"<|python_start|>{PYTHONIC}"],
)
def test_llama4_pythonic_drops_its_markers(text):
    assert extract("llama4_pythonic", text) == (None, PY_WANT)
    parser = get_tool_parser("llama4_pythonic")
    assert_readings_only_grow(parser, text)
    assert assert_stream_assembles(text, ToolPlan(parser=parser))


def test_llama4_pythonic_text_is_content():
    assert extract("llama4_pythonic", "Tokyo is sunny.") == ("Tokyo is sunny.", [])
    assert extract("llama4_pythonic", "<|python_start|>not a call") == ("not a call", [])
    assert extract("llama4_pythonic", "<|python_st", final=False) == ("", [])


def test_llama4_json_reads_as_llama3_json():
    text = '{"name": "bash", "parameters": {"command": "ls"}}'
    assert extract("llama4_json", text) == extract("llama3_json", text) == (
        None, [("bash", {"command": "ls"})])  # fmt: skip


CALL = '{"name": "bash", "arguments": {"command": "ls"}}'


def test_longcat_reads_hermes_calls_in_its_tags():
    text = f"Checking.\n<longcat_tool_call>\n{CALL}\n</longcat_tool_call>"
    assert extract("longcat", text) == ("Checking.", [("bash", {"command": "ls"})])
    # Hermes' own tags are text to it.
    hermes = f"<tool_call>{CALL}</tool_call>"
    assert extract("longcat", hermes) == (hermes, [])
    assert assert_stream_assembles(text, ToolPlan(parser=get_tool_parser("longcat")))


@pytest.mark.parametrize(
    "text, want",
    [
        ("<response>\nParis is sunny.\n</response>", ("Paris is sunny.", [])),
        (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n",
         ("Let me check.", [("bash", {"command": "ls"})])),
    ],
)  # fmt: skip
def test_ernie45_drops_its_response_markers(text, want):
    assert extract("ernie45", text) == want
    assert_stream_assembles(text, ToolPlan(parser=get_tool_parser("ernie45")))


def test_the_hermes_variants_hold_strict_calls_in_their_tags():
    from vllm.entrypoints.openai.tool_parsers import tool_parser_class

    tag = tool_parser_class("longcat").structural_tag({"bash": None})
    assert tag["triggers"] == ["<longcat_tool_call"]
    assert tag["structures"][0]["end"] == "}\n</longcat_tool_call>"
    assert tool_parser_class("ernie45").structural_tag({"bash": None})["triggers"] == ["<tool_call"]
