"""--tool-call-parser / --reasoning-parser cohere_command3 and cohere_command4: Cohere
Command's action blocks and thinking markers, whole and streamed."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_qwen3coder_parser import assert_stream_assembles
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig, ToolPlan, plan_tool_calls
from vllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from vllm.reasoning import get_reasoning_parser, reasoning_parser_names

THINK = "<|START_THINKING|>I will look it up.<|END_THINKING|>"
ACTION = (
    "<|START_ACTION|>[\n"
    '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}},\n'
    '    {"tool_call_id": "1", "tool_name": "bash", "parameters": {"command": "ls ]["}}\n'
    "]<|END_ACTION|>"
)
WANT = [("get_weather", {"city": "Paris"}), ("bash", {"command": "ls ]["})]
ANSWER3 = "<|START_RESPONSE|>It is sunny.<|END_RESPONSE|>"
ANSWER4 = "<|START_TEXT|>It is sunny.<|END_TEXT|>"


def extract(text: str, name: str = "cohere_command3"):
    out = get_tool_parser(name).extract(text, True)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls]


def test_names_are_offered():
    names = {"cohere_command3", "cohere_command4"}
    assert names <= set(tool_parser_names()) and names <= set(reasoning_parser_names())
    assert get_tool_parser("cohere_command4").keeps_special_tokens


def test_calls_and_answers():
    assert extract(ACTION) == (None, WANT)
    assert extract(ANSWER3) == ("It is sunny.", [])
    assert extract(ANSWER4, "cohere_command4") == ("It is sunny.", [])
    # Not streamed, an answer without calls loses its markers too.
    plan = ToolPlan(parser=get_tool_parser("cohere_command3"))
    assert plan.message(ANSWER3, "stop")[0]["content"] == "It is sunny."
    assert extract("Let me check. " + ACTION[: -len("<|END_ACTION|>")]) == ("Let me check.", WANT)


@pytest.mark.parametrize(
    "text",
    [
        "<|START_ACTION|>[]<|END_ACTION|>",
        '<|START_ACTION|>[{"tool_name": "f", "parameters": {"x": oops}}]<|END_ACTION|>',
        '<|START_ACTION|>[{"parameters": {}}]<|END_ACTION|>',
        '<|START_ACTION|>{"tool_name": "f", "parameters": {}}<|END_ACTION|>',
        ACTION[:60],  # cut off
    ],
)
def test_bad_blocks_are_content_whole(text):
    assert extract(text) == (text, [])


@pytest.mark.parametrize(
    "text, reasoning",
    [
        (ACTION, None),
        (THINK + ACTION, "cohere_command3"),
        (THINK + ANSWER3, "cohere_command3"),
        ("Plain < text <| and <|START_RE", None),
        ("<|START_RESPONSE|>Checking.<|END_RESPONSE|>" + ACTION, None),
    ],
)
def test_stream_assembles_to_the_message(text, reasoning):
    plan = ToolPlan(
        parser=get_tool_parser("cohere_command3"),
        reasoning=get_reasoning_parser(reasoning) if reasoning else None,
    )
    want = assert_stream_assembles(text, plan)
    assert bool(want) == ("ACTION" in text)


def test_reasoning_parser_and_special_tokens():
    parser = get_reasoning_parser("cohere_command4")
    out = parser.extract(THINK + ANSWER4, final=True)
    assert (out.reasoning, out.content) == ("I will look it up.", ANSWER4)
    assert parser.extract("No thinking.", final=True).reasoning is None
    assert parser.extract("<|START_THINKING|>cut", final=True).reasoning == "cut"
    assert parser.end_of_reasoning is None
    # The reasoning parser alone keeps the markers in the request's text.
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    plan = plan_tool_calls(request, ToolCallingConfig(reasoning_parser="cohere_command3"))
    assert plan.keep_special_tokens
    plan = plan_tool_calls(request, ToolCallingConfig(reasoning_parser="qwen3"))
    assert not plan.keep_special_tokens
