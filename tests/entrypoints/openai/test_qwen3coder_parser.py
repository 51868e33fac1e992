"""--tool-call-parser qwen3_coder: Qwen3-Coder's XML calls, typed by the request's tool
schemas, whole and streamed."""

from __future__ import annotations

import json
import random

import pytest

from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig, ToolPlan, plan_tool_calls
from vllm.entrypoints.openai.tool_parsers import get_tool_parser, tool_parser_names
from vllm.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import typed_value
from vllm.reasoning import get_reasoning_parser

BASH = {
    "name": "bash",
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "string"},
            "timeout": {"type": "integer"},
            "env": {"type": "object"},
            "paths": {"type": "array", "items": {"type": "string"}},
            "verbose": {"type": "boolean"},
            "ratio": {"type": "number"},
        },
    },
}
FUNCTIONS = {"bash": BASH}


def block(name: str, **params: str) -> str:
    """A call as Qwen3-Coder's template writes one."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CALL = block("bash", command="ls -la\n| grep <b>", timeout="30", verbose="True")
TWO = "I will look.\n" + CALL + "\n" + block("bash", command="pwd") + "\nDone."


def extract(text: str, final: bool = True, functions=FUNCTIONS):
    out = get_tool_parser("qwen3_coder", functions).extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_both_names_are_offered():
    assert {"qwen3_coder", "qwen3_xml"} <= set(tool_parser_names())


def test_calls_content_and_types():
    content, calls = extract(TWO)
    assert content == "I will look.\n\n\nDone."  # the text between the calls, joined
    assert calls == [
        ("bash", {"command": "ls -la\n| grep <b>", "timeout": 30, "verbose": True}),
        ("bash", {"command": "pwd"}),
    ]
    # Without the <tool_call> wrapper, as vLLM reads it too.
    bare = "<function=bash>\n<parameter=command>\nls\n</parameter>\n</function>"
    assert extract(bare) == (None, [("bash", {"command": "ls"})])


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("30", {"type": "integer"}, 30),
        ("3.5", {"type": "integer"}, "3.5"),
        ("3.5", {"type": "number"}, 3.5),
        ("2", {"type": "number"}, 2),
        ("nan", {"type": "number"}, "nan"),
        ("True", {"type": "boolean"}, True),
        ("yes", {"type": "boolean"}, "yes"),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("{'a': None}", {"type": "object"}, {"a": None}),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ('["x", "y"]', {"type": "array"}, ["x", "y"]),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is no JSON array
        ("null", {"type": ["integer", "null"]}, None),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("abc", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "abc"),
        ("2", {"enum": [1, 2, 3]}, 2),
        ("42", {"type": "string"}, "42"),
        ("42", None, "42"),
    ],
)
def test_values_are_typed_by_the_schema(raw, schema, value):
    assert typed_value(raw, schema) == value
    assert type(typed_value(raw, schema)) is type(value)


def test_parameters_of_unknown_tools_stay_strings():
    text = block("other", n="5")
    assert extract(text) == (None, [("other", {"n": "5"})])
    assert extract(block("bash", timeout="5"), functions=None) == (
        None,
        [("bash", {"timeout": "5"})],
    )


def test_a_value_left_open_ends_at_the_next_parameter():
    text = (
        "<tool_call>\n<function=bash>\n<parameter=command>\nls\n"
        "<parameter=timeout>\n5\n</function>\n</tool_call>"
    )
    assert extract(text) == (None, [("bash", {"command": "ls", "timeout": 5})])


def test_repeated_parameter_keeps_the_first():
    text = block("bash", command="a").replace(
        "</function>", "<parameter=command>\nb\n</parameter>\n</function>"
    )
    assert extract(text)[1] == [("bash", {"command": "a"})]


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\nhello\n</tool_call>",
        "<tool_call>\n<function=two words\nhere>\n</function>\n</tool_call>",
        "<tool_call>\n<function=bash>\nstray text\n</function>\n</tool_call>",
        "<tool_call>\n<function=bash>\n<parameter=command>\nls -l",  # cut inside a value
        "<tool_call>\n<function=bash",  # cut inside the name
    ],
)
def test_malformed_or_cut_calls_are_content(bad):
    assert extract(bad) == (bad.strip(), [])


def test_cut_after_a_parameter_is_a_call():
    # A stop string at </parameter> (or max_tokens right there): the parameters are whole.
    cut = CALL[: CALL.index("</parameter>") + len("</parameter>")]
    assert extract(cut)[1] == [("bash", {"command": "ls -la\n| grep <b>"})]


def chunkings(text: str) -> list[list[str]]:
    """``text`` cut into pieces: a character at a time, whole, and 20 random cuttings."""
    rng = random.Random(0)
    out = [list(text), [text]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 8)))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def assert_stream_assembles(text: str, plan: ToolPlan) -> list[list[str]]:
    """Every cutting of ``text`` (``chunkings``) streamed through ``plan`` adds up to the
    whole message's calls, content and reasoning; returns the calls' [name, arguments]."""
    message, _ = plan.message(text, "stop")
    want = [
        [c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", [])
    ]
    for pieces in chunkings(text):
        got = _assemble(text, pieces, plan)
        assert [got["calls"][i] for i in sorted(got["calls"])] == want
        assert got["content"] == (message["content"] or "")
        assert got["reasoning"] == message.get("reasoning", "")
    return want


def assert_readings_only_grow(parser, text: str) -> None:
    """Cut anywhere, ``parser``'s reading of ``text`` is safe (a final reading does not
    raise) and, streaming, only grows: content and each call's arguments extend the last
    reading's, calls are never taken back."""
    before = parser.extract("", final=False)
    for i in range(1, len(text) + 1):
        parser.extract(text[:i], final=True)
        now = parser.extract(text[:i], final=False)
        assert now.content.startswith(before.content)
        for old, new in zip(before.calls, now.calls, strict=False):
            assert new.arguments.startswith(old.arguments) and new.name == old.name
        assert len(now.calls) >= len(before.calls)
        before = now


def _assemble(text: str, pieces: list[str], plan: ToolPlan) -> dict:
    streamer = plan.streamer()
    got: dict = {"content": "", "reasoning": "", "calls": {}}
    for i, piece in enumerate(pieces):
        delta = streamer.delta(piece, i == len(pieces) - 1)
        got["content"] += delta.get("content", "")
        got["reasoning"] += delta.get("reasoning", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:
                got["calls"][d["index"]] = [d["function"]["name"], ""]
            got["calls"][d["index"]][1] += d["function"]["arguments"]
    return got


@pytest.mark.parametrize(
    "text",
    [
        CALL,
        TWO,
        "No call here, just < and <tool and <function.",
        "<think>Which command?</think>\n" + CALL,
    ],
)
def test_stream_assembles_to_the_message(text):
    reasoning = get_reasoning_parser("qwen3") if text.startswith("<think>") else None
    plan = ToolPlan(parser=get_tool_parser("qwen3_coder", FUNCTIONS), reasoning=reasoning)
    assert_stream_assembles(text, plan)


def test_a_requests_tools_type_its_calls():
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "list"}],
            "tools": [{"type": "function", "function": BASH}],
        }
    )
    config = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    plan = plan_tool_calls(request, config)
    message, finish = plan.message(CALL, "stop")
    assert finish == "tool_calls"
    arguments = json.loads(message["tool_calls"][0]["function"]["arguments"])
    assert arguments["timeout"] == 30 and arguments["verbose"] is True
