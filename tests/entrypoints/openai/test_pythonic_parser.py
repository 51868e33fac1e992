"""--tool-call-parser pythonic: a Python list of calls with literal keyword arguments,
whole and streamed."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_qwen3coder_parser import _assemble, chunkings
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.entrypoints.openai.tool_parsers import get_tool_parser

CALLS = (
    '[get_weather(city="Tokyo", days=3, units=None), '
    'bash(command=\'ls -la, (x) [y]\', env={\'A\': [1, 2.5, True]}), fs.read(path="""a\\"b""")]'
)
WANT = [
    ("get_weather", {"city": "Tokyo", "days": 3, "units": None}),
    ("bash", {"command": "ls -la, (x) [y]", "env": {"A": [1, 2.5, True]}}),
    ("fs.read", {"path": 'a"b'}),
]


def extract(text: str):
    out = get_tool_parser("pythonic").extract(text, True)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls]


def test_calls_with_literal_arguments():
    assert extract(CALLS) == (None, WANT)
    assert extract(" [noop()] ") == (None, [("noop", {})])


@pytest.mark.parametrize(
    "text",
    [
        "The answer is [1].",
        "[1, 2]",
        "[]",
        "[f(1)]",  # positional arguments
        "[f(a=x)]",  # not a literal
        "[f(**kw)]",
        "[f(a={1, 2})]",  # a set has no JSON form
        "[f(a=1)] and more",
        "[f(a=1)",  # cut before the list closes
    ],
)
def test_anything_else_is_content_whole(text):
    assert extract(text) == (text, [])


def test_stream_assembles_to_the_message():
    text = CALLS
    plan = ToolPlan(parser=get_tool_parser("pythonic"))
    message, finish = plan.message(text, "stop")
    assert finish == "tool_calls"
    want = [[c["function"]["name"], c["function"]["arguments"]] for c in message["tool_calls"]]
    for pieces in chunkings(text):
        got = _assemble(text, pieces, plan)
        assert [got["calls"][i] for i in sorted(got["calls"])] == want
        assert got["content"] == ""


def test_plain_text_streams_as_content():
    plan = ToolPlan(parser=get_tool_parser("pythonic"))
    text = "Tokyo is sunny [source: 1]."
    got = _assemble(text, list(text), plan)
    assert got == {"content": text, "reasoning": "", "calls": {}}


def test_json_literal_names_are_read_as_vllm_reads_them():
    text = "[f(a=true, b=false, c=null, d=[true, {'k': null}])]"
    assert extract(text) == (
        None,
        [("f", {"a": True, "b": False, "c": None, "d": [True, {"k": None}]})],
    )
    assert extract("[f(a=yes)]") == ("[f(a=yes)]", [])
