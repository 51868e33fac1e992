"""--tool-call-parser gemma4 and --reasoning-parser gemma4: Gemma 4's
``<|tool_call>call:name{...}<tool_call|>`` calls in its own argument notation, whole and
streamed, and its ``<|channel>thought ...<channel|>`` reasoning."""

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

Q = '<|"|>'
FUNCTIONS = {"get_weather": {"name": "get_weather", "parameters": {}}}


def call(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


ONE = call("get_weather", f"city:{Q}San Francisco, CA{Q},days:3,detailed:true")
TWO = "Checking both." + (
    call("get_weather", f"city:{Q}Paris{Q},units:{{temp:{Q}C{Q},wind:null}},hours:[9,{Q}noon{Q}]")
    + call("get_time", "")
)


def extract(text: str, final: bool = True):
    out = get_tool_parser("gemma4", FUNCTIONS).extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_names_are_offered():
    assert "gemma4" in tool_parser_names() and "gemma4" in reasoning_parser_names()
    assert tool_parser_class("gemma4").keeps_special_tokens
    assert get_reasoning_parser("gemma4").keeps_special_tokens


def test_one_call():
    assert extract(ONE) == (
        None,
        [("get_weather", {"city": "San Francisco, CA", "days": 3, "detailed": True})],
    )


def test_nested_values_and_two_calls_after_content():
    assert extract(TWO) == (
        "Checking both.",
        [
            (
                "get_weather",
                {"city": "Paris", "units": {"temp": "C", "wind": None}, "hours": [9, "noon"]},
            ),
            ("get_time", {}),
        ],
    )


@pytest.mark.parametrize(
    "args, want",
    [
        (f"{Q}a key{Q}:1", {"a key": 1}),  # a quoted key
        ("x:celsius", {"x": "celsius"}),  # a bare word stays a string
        ("x:-2.5e1", {"x": -25.0}),
        ("x:NaN", {"x": "NaN"}),  # JSON cannot hold NaN: the text
        (f"x:{Q}{{not: an object}}, [1]{Q}", {"x": "{not: an object}, [1]"}),  # quoted text
        ("x:1,x:2", {"x": 1}),  # a key twice keeps its first value
        (" x : [ ] , y : { } ", {"x": [], "y": {}}),
    ],
)
def test_argument_notation(args, want):
    assert extract(call("f", args))[1] == [("f", want)]


@pytest.mark.parametrize(
    "bad",
    [
        "<|tool_call>get_weather{}<tool_call|>",  # no call: prefix
        "<|tool_call>call:{x:1}<tool_call|>",  # no name
        "<|tool_call>call:f x:1<tool_call|>",  # no brace
        "<|tool_call>call:f{x:1 <b>}<tool_call|>",  # a tag where a value should be
        "<|tool_call>call:f{x:1]}<tool_call|>",  # a closer that closes nothing
        "<|tool_call>call:f{:1}<tool_call|>",  # no key
        "<|tool_call>call:f{x:1}junk<tool_call|>",
    ],
)
def test_malformed_calls_are_content(bad):
    assert extract(bad) == (bad, [])


def test_cut_after_the_arguments_holds_and_inside_them_does_not():
    assert extract(ONE[: -len("<tool_call|>")])[1] == extract(ONE)[1]
    assert extract(ONE.replace("<tool_call|>", "<turn|>"))[1] == extract(ONE)[1]
    cut = ONE[: ONE.index("days")]
    assert extract(cut) == (cut, [])


def test_every_cut_point_is_safe_and_only_grows():
    assert_readings_only_grow(get_tool_parser("gemma4", FUNCTIONS), TWO)


def test_streamed_arguments_grow_an_argument_at_a_time():
    parser = get_tool_parser("gemma4", FUNCTIONS)
    seen = []
    for i in range(len(ONE) + 1):
        calls = parser.extract(ONE[:i], final=False).calls
        if calls and (not seen or seen[-1] != calls[0].arguments):
            seen.append(calls[0].arguments)
    assert seen == [
        "{",
        '{"city": "San Francisco, CA"',
        '{"city": "San Francisco, CA", "days": 3',
        '{"city": "San Francisco, CA", "days": 3, "detailed": true}',
    ]


THOUGHT = "<|channel>thought\nThe user wants Paris.<channel|>"


@pytest.mark.parametrize(
    "text",
    [ONE, TWO, TWO + "\nDone.", THOUGHT + ONE, THOUGHT + "Sunny.", "No call: a <|tool or call:x"],
)
@pytest.mark.parametrize("reasoning", [None, "gemma4"])
def test_stream_assembles_to_the_message(text, reasoning):
    parser = get_reasoning_parser(reasoning) if reasoning else None
    plan = ToolPlan(parser=get_tool_parser("gemma4", FUNCTIONS), reasoning=parser)
    calls = assert_stream_assembles(text, plan)
    assert len(calls) == text.count("<|tool_call>")


@pytest.mark.parametrize(
    "text, reasoning, content",
    [
        (THOUGHT + "\nSunny.", "The user wants Paris.", "Sunny."),
        ("Sunny.", None, "Sunny."),  # no block: all content
        ("<|channel>thought\nStill thinking", "Still thinking", ""),  # never closed
        ("<|channel><channel|>Sunny.", "", "Sunny."),  # an empty block, no label
    ],
)
def test_reasoning_block(text, reasoning, content):
    got = get_reasoning_parser("gemma4").extract(text, final=True)
    assert (got.reasoning, got.content) == (reasoning, content)


def test_reasoning_streams_without_the_label_or_a_partial_tag():
    parser = get_reasoning_parser("gemma4")
    text = THOUGHT + "Sunny."
    previous = ("", "")
    for i in range(len(text) + 1):
        got = parser.extract(text[:i], final=False)
        now = (got.reasoning or "", got.content)
        assert now[0].startswith(previous[0]) and now[1].startswith(previous[1])
        assert "<" not in now[0] and "thought" not in now[0]
        previous = now
    assert previous == ("The user wants Paris.", "Sunny.")


def test_thinking_asked_for_sets_the_end_of_reasoning():
    assert get_reasoning_parser("gemma4").end_of_reasoning is None
    thinking = get_reasoning_parser("gemma4", {"enable_thinking": True})
    assert thinking.end_of_reasoning == "<channel|>"
