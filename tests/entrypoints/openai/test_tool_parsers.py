"""Tool parsers on SmolLM2-135M-Instruct's real outputs (greedy, with
examples/tool_chat_template_chatml_hermes.jinja), and their streaming form."""

from __future__ import annotations

import json
import random

import pytest

from vllm.entrypoints.openai.tool_calling import ToolCallStreamer, ToolPlan
from vllm.entrypoints.openai.tool_parsers import (
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)

# Greedy outputs of the embedded model (max_tokens 80) asked to repeat a call.
ONE_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
)
# Its answers when it did not call a tool.
PLAIN = "I'm fine. Just checking my email."
TOOL_RESPONSE_ECHO = "<tool_response>\n20 C\n</tool_response>"
# What guided decoding makes it write for tool_choice "required" / a named function.
REQUIRED = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
NAMED = '{"name": "bash", "arguments": {"command": "ls -la"}}'


def calls(parser: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    out = get_tool_parser(parser).extract(text, final=True)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls]


def test_registry_feeds_the_flag():
    assert {"hermes", "json", "llama3_json"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("nope")


def test_adding_a_parser_is_one_class():
    @register_tool_parser("test_upper")
    class Upper(ToolParser):
        def extract_tool_calls(self, text, final):
            return get_tool_parser("json").extract(text.lower(), final)

    assert "test_upper" in tool_parser_names()
    assert calls("test_upper", NAMED.upper().replace("LS -LA", "ls -la"))[1][0][0] == "bash"


def test_hermes_complete_call():
    assert calls("hermes", ONE_CALL) == (None, [("get_weather", {"city": "Paris"})])


def test_hermes_several_calls_and_content():
    content, found = calls("hermes", "Let me check.\n" + TWO_CALLS)
    assert content == "Let me check."
    assert found == [("get_weather", {"city": "Paris"}), ("bash", {"command": "ls -la"})]


@pytest.mark.parametrize("text", [PLAIN, TOOL_RESPONSE_ECHO, ""])
def test_hermes_plain_text_is_content(text):
    assert calls("hermes", text) == (text or None, [])


def test_hermes_cut_off_by_max_tokens():
    # Cut inside the JSON: not a call; the text is returned as content.
    cut = ONE_CALL[:40]
    assert calls("hermes", cut) == (cut, [])
    # Cut after the object but before </tool_call> (a stop string, or max_tokens): a call.
    assert calls("hermes", ONE_CALL[: ONE_CALL.index("}}") + 2])[1][0][0] == "get_weather"
    # Every cut point: no exception, and a call only once its JSON is whole.
    for i in range(len(TWO_CALLS) + 1):
        get_tool_parser("hermes").extract(TWO_CALLS[:i], final=True)


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
        '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": "not an object"}\n</tool_call>',
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        '<tool_call>{"name": "f", "arguments": {"\\x": 1}}</tool_call>',
    ],
)
def test_malformed_calls_are_returned_as_content(bad):
    assert calls("hermes", bad) == (bad, [])
    message, finish = ToolPlan(parser=get_tool_parser("hermes")).message(bad, "stop")
    assert message == {"role": "assistant", "content": bad} and finish == "stop"


def test_a_malformed_call_next_to_a_good_one():
    bad = "<tool_call>{oops}</tool_call>"
    content, found = calls("hermes", ONE_CALL + "\n" + bad)
    assert content == bad and found == [("get_weather", {"city": "Paris"})]


def test_json_parser_forms():
    assert calls("json", REQUIRED) == (None, [("get_weather", {"city": "Paris"})])
    assert calls("json", NAMED) == (None, [("bash", {"command": "ls -la"})])
    two = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert calls("llama3_json", two) == (None, [("a", {"x": 1}), ("b", {})])
    assert calls("json", "<|python_tag|>" + NAMED)[1] == [("bash", {"command": "ls -la"})]
    for text in (PLAIN, REQUIRED[:30], "[]", '{"not": "a call"}', NAMED + " trailing"):
        assert calls("json", text) == (text, []), text


def test_granite_parser_reads_both_tags_and_none():
    want = [("get_weather", {"city": "Paris"})]
    for tag in ("<|tool_call|>", "<tool_call>", ""):
        assert calls("granite", tag + REQUIRED) == (None, want), tag
    assert calls("granite", PLAIN) == (PLAIN, [])
    assert calls("granite", "<tool_call>not json") == ("<tool_call>not json", [])


def test_message_shape_and_finish_reason():
    plan = ToolPlan(parser=get_tool_parser("hermes"))
    message, finish = plan.message(ONE_CALL, "stop")
    assert finish == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    named = ToolPlan(parser=get_tool_parser("json"), forced_name="bash")
    assert named.message(NAMED, "stop")[1] == "stop"  # as OpenAI for a forced function


def test_guided_output_cut_by_max_tokens_keeps_its_complete_calls():
    looping = REQUIRED[:-1] + ", " + REQUIRED[1:-1] + ', {"name": "get_wea'
    required = ToolPlan(parser=get_tool_parser("json"), guided=True)
    message, finish = required.message(looping, "length")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"] * 2
    assert finish == "tool_calls" and message["content"] is None
    unguided = ToolPlan(parser=get_tool_parser("json"))
    as_text = {"role": "assistant", "content": looping}
    assert unguided.message(looping, "length") == (as_text, "length")


def assemble(parser: str, text: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``pieces`` (which join to ``text``) as stream deltas; assemble as a client."""
    assert "".join(pieces) == text
    streamer = ToolCallStreamer(get_tool_parser(parser))
    content, found = "", {}
    for i, piece in enumerate(pieces):
        delta = streamer.delta(piece, final=i == len(pieces) - 1)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            if "id" in d:
                assert d["index"] == len(found) and d["type"] == "function"
                found[d["index"]] = [d["function"]["name"], ""]
            found[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(v) for v in found.values()]


@pytest.mark.parametrize(
    "parser, text",
    [
        ("hermes", ONE_CALL),
        ("hermes", "Let me check.\n" + TWO_CALLS + "\nDone."),
        ("hermes", PLAIN),
        ("hermes", "a < b and <tool_c is not a tag"),
        ("json", REQUIRED),
        ("json", NAMED),
        ("json", PLAIN),
        ("json", '[{"name": "a", "arguments": {"s": "}]\\"{"}}, {"name": "b", "arguments": {}}]'),
        ("granite", "<|tool_call|>" + REQUIRED),
        ("granite", "<tool_call>" + REQUIRED),
    ],
)
def test_stream_assembles_to_the_non_streaming_message(parser, text):
    message, _ = ToolPlan(parser=get_tool_parser(parser)).message(text, "stop")
    want_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    want_content = (message["content"] or "").strip() if want_calls else text.strip()
    rng = random.Random(0)
    chunkings = [list(text), [text]]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        chunkings.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in chunkings:
        assert assemble(parser, text, pieces) == (want_content, want_calls)


def _deep_call(depth: int) -> str:
    arguments = "[" * depth + "]" * depth
    return '{"name": "f", "arguments": {"x": ' + arguments + "}}"


@pytest.mark.parametrize("parser, wrap", [("hermes", "<tool_call>{}</tool_call>"), ("json", "{}")])
def test_output_nested_past_the_stack_is_content(parser, wrap):
    # A model's output nested deeper than json's recursion limit (RecursionError from
    # json.loads): the text is the content, no call, and nothing raises.
    text = wrap.format(_deep_call(20_000))
    plan = ToolPlan(parser=get_tool_parser(parser))
    message, finish = plan.message(text, "stop")
    assert message == {"role": "assistant", "content": text} and finish == "stop"
    streamer = ToolCallStreamer(get_tool_parser(parser))
    assert streamer.delta(text, final=True) == {"content": text} and not streamer.called


def test_a_failing_parser_returns_the_text_as_content():
    class Broken(ToolParser):
        def extract_tool_calls(self, text, final):
            raise RuntimeError("bug")

    assert Broken().extract(" text ", final=True).content == "text"
    assert Broken().extract("text", final=False).content == ""
    assert Broken().extract("", final=True).content is None
