"""--tool-call-parser deepseek_v32: DeepSeek-V3.2's DSML ``function_calls`` blocks, values
typed by the model's own ``string`` attribute, whole and streamed."""

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
from vllm.reasoning import get_reasoning_parser

D = "｜DSML｜"
FUNCTIONS = {"get_weather": {"name": "get_weather", "parameters": {}}}


def param(name: str, value: str, string: str | None = "true") -> str:
    flag = "" if string is None else f' string="{string}"'
    return f'<{D}parameter name="{name}"{flag}>{value}</{D}parameter>\n'


def invoke(name: str, *params: str) -> str:
    return f'<{D}invoke name="{name}">\n' + "".join(params) + f"</{D}invoke>\n"


def block(*invokes: str) -> str:
    return f"<{D}function_calls>\n" + "".join(invokes) + f"</{D}function_calls>"


ONE = block(
    invoke(
        "get_weather",
        param("city", "杭州"),
        param("days", "3", "false"),
        param("detailed", "true", "false"),
    )
)
TWO = "Checking both.\n\n" + block(
    invoke("get_weather", param("city", " Paris "), param("units", '{"t": "C"}', "false")),
    invoke("get_time"),
)


def extract(text: str, final: bool = True):
    out = get_tool_parser("deepseek_v32", FUNCTIONS).extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_name_is_offered_and_keeps_special_tokens():
    assert "deepseek_v32" in tool_parser_names()
    assert tool_parser_class("deepseek_v32").keeps_special_tokens


def test_one_call_typed_by_the_string_attribute():
    assert extract(ONE) == (None, [("get_weather", {"city": "杭州", "days": 3, "detailed": True})])


def test_two_calls_after_content_and_strings_kept_verbatim():
    assert extract(TWO) == (
        "Checking both.",
        [("get_weather", {"city": " Paris ", "units": {"t": "C"}}), ("get_time", {})],
    )


@pytest.mark.parametrize(
    "raw, string, value",
    [
        ("3", "true", "3"),  # a string the model says is one stays one
        ("3.5", "false", 3.5),
        ("[1, 2]", None, [1, 2]),  # no attribute: JSON when it is JSON
        ("not json", "false", "not json"),  # ...else the text
        ("null", "false", None),
        ("NaN", "false", "NaN"),  # JSON cannot hold NaN: the text
        ("1e400", "false", "1e400"),
    ],
)
def test_values(raw, string, value):
    text = block(invoke("f", param("x", raw, string)))
    assert extract(text)[1] == [("f", {"x": value})]


@pytest.mark.parametrize(
    "bad",
    [
        f"<{D}function_calls>\n</{D}function_calls>",  # no call
        block(invoke("f", f'<{D}parameter name=x string="true">1</{D}parameter>')),  # unquoted
        block(invoke("f", f'<{D}parameter name="x" kind="a">1</{D}parameter>')),
        block(f'<{D}invoke name="">\n</{D}invoke>'),  # no name
    ],
)
def test_malformed_blocks_are_content(bad):
    assert extract(bad) == (bad, [])


def test_cut_after_a_whole_parameter_holds_and_inside_a_value_does_not():
    cut = ONE[: ONE.index(f"</{D}parameter>") + len(f"</{D}parameter>")]
    assert extract(cut)[1] == [("get_weather", {"city": "杭州"})]
    cut = ONE[: ONE.index("杭州") + 1]
    assert extract(cut)[1] == []


def test_every_cut_point_is_safe_and_only_grows():
    assert_readings_only_grow(get_tool_parser("deepseek_v32", FUNCTIONS), TWO)


@pytest.mark.parametrize("text", [ONE, TWO, TWO + "\nDone.", "<think>Which?</think>" + ONE])
@pytest.mark.parametrize("reasoning", [None, "deepseek_v3"])
def test_stream_assembles_to_the_message(text, reasoning):
    parser = get_reasoning_parser(reasoning) if reasoning else None
    plan = ToolPlan(parser=get_tool_parser("deepseek_v32", FUNCTIONS), reasoning=parser)
    calls = assert_stream_assembles(text, plan)
    assert len(calls) == text.count(f"<{D}invoke")


def test_streamed_arguments_grow_a_parameter_at_a_time():
    parser = get_tool_parser("deepseek_v32", FUNCTIONS)
    seen = []
    for i in range(len(ONE) + 1):
        calls = parser.extract(ONE[:i], final=False).calls
        if calls and (not seen or seen[-1] != calls[0].arguments):
            seen.append(calls[0].arguments)
    assert seen == [
        "{",
        '{"city": "杭州"',
        '{"city": "杭州", "days": 3',
        '{"city": "杭州", "days": 3, "detailed": true',
        '{"city": "杭州", "days": 3, "detailed": true}',
    ]
