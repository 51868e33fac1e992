"""--tool-call-parser deepseek_v3 / deepseek_v31 and --reasoning-parser deepseek_v3:
DeepSeek-V3's fenced JSON calls and V3.1's bare ones between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>``, whole and streamed; V3's reasoning only when asked for."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_qwen3coder_parser import (
    assert_readings_only_grow,
    assert_stream_assembles,
)
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from vllm.reasoning import get_reasoning_parser, reasoning_parser_names

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3(name: str, args: str) -> str:
    """A call as DeepSeek-V3 / R1-0528 writes one."""
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31(name: str, args: str) -> str:
    """DeepSeek-V3.1's."""
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


def section(*calls: str, sep: str = "") -> str:
    return CALLS_BEGIN + sep.join(calls) + CALLS_END


PARIS = '{"city": "Paris", "days": 3}'
NESTED = '{"q": "a } b ``` c", "opts": {"n": [1, 2]}}'
WRITE = {
    "deepseek_v3": v3,
    "deepseek_v31": v31,
}


def extract(text: str, name: str, final: bool = True):
    out = get_tool_parser(name).extract(text, final)
    return out.content, [(c.name, c.arguments) for c in out.calls if c.complete]


def test_names_are_offered():
    assert {"deepseek_v3", "deepseek_v31"} <= set(tool_parser_names())
    assert "deepseek_v3" in reasoning_parser_names()


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
def test_several_calls_and_text_before(name):
    call = WRITE[name]
    text = "Checking both.\n" + section(call("get_weather", PARIS), call("search", NESTED))
    assert extract(text, name) == (
        "Checking both.",
        [("get_weather", PARIS), ("search", NESTED)],  # the model's own JSON text
    )


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
def test_whitespace_between_calls_and_text_after(name):
    call = WRITE[name]
    text = "Both:" + section(call("a", "{}"), call("b", '{"x": 1}'), sep="\n \n") + " Done."
    # The section's newlines are not content; the text after it is (vLLM drops it).
    assert extract(text, name) == ("Both: Done.", [("a", "{}"), ("b", '{"x": 1}')])


def test_v3_multiline_arguments_and_empty_arguments():
    pretty = '{\n  "city": "Paris"\n}'
    text = section(v3("get_weather", pretty), v3("get_time", "").replace("\n\n", "\n"))
    assert extract(text, "deepseek_v3") == (None, [("get_weather", pretty), ("get_time", "{}")])


def test_v31_call_without_section_and_empty_arguments():
    assert extract(v31("get_time", ""), "deepseek_v31") == (None, [("get_time", "{}")])
    # A V3.1 call is not a V3 one (no fence) and stays content there.
    text = section(v31("get_time", "{}"))
    assert extract(text, "deepseek_v3") == (text, [])


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("deepseek_v3", section(v3("f", '{"a": 1'))),  # arguments not closed
        ("deepseek_v3", section(v3("f", '["a"]'))),  # not an object
        ("deepseek_v3", section(v3("f", '{"a": tru}'))),  # not JSON
        ("deepseek_v3", section(v3("two\nlines", "{}"))),
        ("deepseek_v3", CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f\nno fence"),
        ("deepseek_v3", section(v3("f", "{}").replace("```json", "```JSON"))),
        ("deepseek_v3", CALLS_BEGIN + CALL_BEGIN + "func"),  # cut in the header
        ("deepseek_v3", CALLS_BEGIN),  # cut right after the section opens
        ("deepseek_v3", CALLS_BEGIN + "text" + CALLS_END),  # no call in the section
        ("deepseek_v31", section(v31("", "{}"))),  # no name
        ("deepseek_v31", section(v31("f", '{"a": 1}, {"b": 2}'))),
        ("deepseek_v31", CALLS_BEGIN + CALL_BEGIN + "f" + SEP + '{"a": "cut'),
    ],
)
def test_malformed_or_cut_calls_are_content(name, bad):
    assert extract("Before. " + bad, name) == ("Before. " + bad, [])
    plan = ToolPlan(parser=get_tool_parser(name))
    message, finish = plan.message(bad, "length")
    assert message == {"role": "assistant", "content": bad} and finish == "length"


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
def test_a_bad_call_next_to_good_ones(name):
    call = WRITE[name]
    bad = call("f", "[1]")
    text = section(call("a", "{}"), bad, call("b", "{}"))
    assert extract(text, name) == (bad, [("a", "{}"), ("b", "{}")])


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
def test_cut_after_the_arguments_is_a_call(name):
    # A stop string right after the JSON (or max_tokens there): the arguments are whole.
    text = "Hi " + section(WRITE[name]("f", PARIS))
    cut = text[: text.index(PARIS) + len(PARIS)]
    assert extract(cut, name) == ("Hi", [("f", PARIS)])


def test_streaming_shows_the_call_at_its_name_and_grows_its_arguments():
    parser = get_tool_parser("deepseek_v3")
    text = "Hi" + section(v3("get_weather", PARIS))
    at_name = text[: text.index("get_weather") + len("get_weather\n")]
    out = parser.extract(at_name, final=False)
    assert out.content == "Hi" and [(c.name, c.arguments) for c in out.calls] == [
        ("get_weather", "")
    ]
    mid = text[: text.index('"Paris"')]
    assert parser.extract(mid, final=False).calls[0].arguments == '{"city": '
    assert parser.extract(text[:-3], final=False).content == "Hi"  # the end tag, held


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
def test_every_cut_point_is_safe_and_only_grows(name):
    call = WRITE[name]
    text = "Let me see.\n" + section(call("get_weather", PARIS), call("s", NESTED), sep="\n")
    assert_readings_only_grow(get_tool_parser(name), text + "\nDone.")
    assert_readings_only_grow(get_tool_parser(name), section(call("f", '{"a": [1')))


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v31"])
@pytest.mark.parametrize(
    "shape",
    [
        "one",
        "two",
        "text_after",
        "bad",
        "no_call",
        "think",
    ],
)
def test_stream_assembles_to_the_message(name, shape):
    call = WRITE[name]
    text = {
        "one": section(call("get_weather", PARIS)),
        "two": "Both:\n" + section(call("a", NESTED), call("b", "{}"), sep="\n"),
        "text_after": section(call("a", "{}")) + " done",
        # A call whose header breaks the format never shows (one broken in its
        # arguments has shown already, as in vLLM: the documented limit).
        "bad": section(call("a", "{}"), call("<b>", "{}")),
        "no_call": "No call: <｜tool and <｜tool▁calls are text.",
        "think": "Paris, then.</think>\n" + section(call("get_weather", PARIS)),
    }[shape]
    reasoning = None
    if shape == "think":
        reasoning = get_reasoning_parser("deepseek_v3", {"thinking": True})
    plan = ToolPlan(parser=get_tool_parser(name), reasoning=reasoning)
    calls = assert_stream_assembles(text, plan)
    assert len(calls) == {"two": 2, "no_call": 0}.get(shape, 1)


def test_v3_reasoning_only_when_asked():
    text = "<think>Plan.</think>Answer"
    off = get_reasoning_parser("deepseek_v3")
    assert off.extract(text, final=True) == off.extract(text, final=False)
    out = off.extract(text, final=True)
    assert (out.reasoning, out.content, out.ended) == (None, text, True)
    assert off.end_of_reasoning is None
    for kwargs in ({"thinking": True}, {"enable_thinking": True}, {"thinking": 1}):
        on = get_reasoning_parser("deepseek_v3", kwargs)
        out = on.extract(text, final=True)
        assert (out.reasoning, out.content) == ("Plan.", "Answer")
        assert on.end_of_reasoning == "</think>"
        # V3.1's template opens the block: no <think> in the output; never closed: all
        # reasoning, as deepseek_r1.
        assert on.extract("Plan.</think>A", final=True).reasoning == "Plan."
        cut = on.extract("Still planning", final=True)
        assert (cut.reasoning, cut.content, cut.ended) == ("Still planning", "", False)
    for kwargs in ({"thinking": False}, {"enable_thinking": False}, {"other": True}):
        assert get_reasoning_parser("deepseek_v3", kwargs).extract(text, True).reasoning is None


def test_arguments_are_json_objects():
    text = section(v31("f", NESTED))
    assert json.loads(extract(text, "deepseek_v31")[1][0][1]) == json.loads(NESTED)
