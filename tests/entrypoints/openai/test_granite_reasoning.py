"""--reasoning-parser granite: Granite 3.2's "Here is my thought process:" / "Here is my
response:" phrases, whole and streamed, only when the request turns thinking on."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.test_reasoning import _stream, assert_readings_grow
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.reasoning import count_reasoning_tokens, get_reasoning_parser, reasoning_parser_names

ON = {"thinking": True}
FULL = "Here is my thought process:\nTwo and two.\nHere is my response:\nThe answer is 4."
SHORT = "Here's my thought process: quick. Here's my response: Four."
CUT = "Here is my thought process:\nStill thinking, cut off"
PLAIN = "The answer is 4. Here is my response: none."


def test_offered():
    assert "granite" in reasoning_parser_names()


@pytest.mark.parametrize(
    ("kwargs", "text", "reasoning", "content"),
    [
        (ON, FULL, "Two and two.\n", "The answer is 4."),
        (ON, SHORT, "quick. ", "Four."),
        (ON, CUT, "Still thinking, cut off", ""),
        (ON, PLAIN, None, PLAIN),  # no thought process: all content
        ({}, FULL, None, FULL),  # thinking off: the model does not reason
    ],
)
def test_final_split(kwargs, text, reasoning, content):
    got = get_reasoning_parser("granite", kwargs).extract(text, final=True)
    assert (got.reasoning, got.content) == (reasoning, content)


@pytest.mark.parametrize("text", [FULL, SHORT, CUT, PLAIN])
def test_streamed_readings_only_grow_and_end_at_the_final_one(text):
    parser = get_reasoning_parser("granite", ON)
    assert_readings_grow(parser, text)
    assert "Here is my res" not in (parser.extract(FULL[:60], False).reasoning or "")


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize("text", [FULL, SHORT, CUT, PLAIN])
def test_stream_adds_up_to_the_message(text, step):
    plan = ToolPlan(
        parser=get_tool_parser("granite"), reasoning=get_reasoning_parser("granite", ON)
    )
    message, _ = plan.message(text, "stop")
    joined = _stream(plan, text, step)
    assert joined["reasoning"] == (message.get("reasoning") or "")
    assert joined["content"] == (message["content"] or "")


def test_reasoning_tokens_are_the_thought_process():
    parser = get_reasoning_parser("granite", ON)
    words = FULL.split(" ")
    ids = list(range(len(words)))

    def decode(part) -> str:
        return " ".join(words[i] for i in part)

    # By words: from "process:\nTwo" (the reasoning's first text) up to the word before
    # the one that completes "Here is my response:" ("two.\nHere", "is", "my" included:
    # the phrase is words, not one tag token).
    assert count_reasoning_tokens(parser, ids, decode) == 5
    assert get_reasoning_parser("granite", ON).end_of_reasoning == "Here is my response:"
    assert get_reasoning_parser("granite").end_of_reasoning is None
