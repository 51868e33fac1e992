"""--tool-call-parser minimax_m2 and --reasoning-parser minimax_m2 / minimax_m2_append_think:
MiniMax-M2's ``<minimax:tool_call><invoke name="..."><parameter name="...">`` blocks, typed
by the request's tool schemas, whole and streamed, and its ``</think>`` reasoning."""

from __future__ import annotations

import json

import pytest

from tests.entrypoints.openai.test_qwen3coder_parser import (
    _assemble,
    assert_readings_only_grow,
    assert_stream_assembles,
)
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.entrypoints.openai.tool_parsers import (
    get_tool_parser,
    tool_parser_class,
    tool_parser_names,
)
from vllm.entrypoints.openai.tool_parsers.minimax_m2_tool_parser import minimax_value
from vllm.reasoning import get_reasoning_parser, reasoning_parser_names

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {"type": "string"},
            "days": {"type": "integer"},
            "detailed": {"type": "boolean"},
            "units": {"type": "object"},
        },
    },
}
FUNCTIONS = {"get_weather": WEATHER, "get_time": {"name": "get_time", "parameters": {}}}


def invoke(name: str, **params: str) -> str:
    """One call as MiniMax-M2's template writes it."""
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def block(*invokes: str) -> str:
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


ONE = block(invoke("get_weather", location="San Francisco, CA", days="3", detailed="true"))
TWO = "Let me check both.\n" + block(
    invoke("get_weather", location="Paris", units='{"t": "C"}'),
    invoke("get_time"),
)


def extract(text: str, final: bool = True, functions=FUNCTIONS):
    out = get_tool_parser("minimax_m2", functions).extract(text, final)
    return out.content, [(c.name, json.loads(c.arguments)) for c in out.calls if c.complete]


def test_names_are_offered():
    assert "minimax_m2" in tool_parser_names()
    assert {"minimax_m2", "minimax_m2_append_think"} <= set(reasoning_parser_names())
    assert tool_parser_class("minimax_m2").keeps_special_tokens
    assert get_reasoning_parser("minimax_m2_append_think").keeps_special_tokens


def test_one_call():
    assert extract(ONE) == (
        None,
        [("get_weather", {"location": "San Francisco, CA", "days": 3, "detailed": True})],
    )


def test_two_calls_in_a_block_after_content():
    assert extract(TWO) == (
        "Let me check both.",
        [("get_weather", {"location": "Paris", "units": {"t": "C"}}), ("get_time", {})],
    )
    # Two blocks, text between and after them: all of it content (vLLM keeps the first).
    text = "A\n" + block(invoke("get_time")) + "\nB\n" + block(invoke("get_time")) + "\nC"
    assert extract(text) == ("A\n\nB\n\nC", [("get_time", {}), ("get_time", {})])


def test_names_quoted_or_not_and_values_stripped():
    text = (
        "<minimax:tool_call><invoke name=get_weather>"
        "<parameter name='location'>\n  Paris \n</parameter>"
        '<parameter name=" days ">5</parameter></invoke></minimax:tool_call>'
    )
    assert extract(text) == (None, [("get_weather", {"location": "Paris", "days": 5})])


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("Paris", {"type": "string"}, "Paris"),
        ("42", {"type": "string"}, "42"),
        ("30", {"type": "integer"}, 30),
        ("abc", {"type": "integer"}, "abc"),
        ("3.5", {"type": "integer"}, 3.5),  # vLLM: no type took it, read as JSON
        ("3.5", {"type": "number"}, 3.5),
        ("2.0", {"type": "number"}, 2),
        ("inf", {"type": "number"}, "inf"),
        ("1e400", {"type": "number"}, "1e400"),
        ("true", {"type": "boolean"}, True),
        ("Yes", {"type": "boolean"}, True),
        ("0", {"type": "boolean"}, False),
        ("off", {"type": "boolean"}, False),
        ("maybe", {"type": "boolean"}, "maybe"),
        ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
        ("{'a': 1}", {"type": "object"}, "{'a': 1}"),  # no Python literals, as vLLM
        ("[1, 2]", {"type": "object"}, [1, 2]),  # JSON all the same (vLLM's fallback)
        ('["x", "y"]', {"type": "array"}, ["x", "y"]),
        ("123", {"type": ["object", "string"]}, "123"),
        ("null", {"type": "integer"}, None),
        ("None", {"anyOf": [{"type": "string"}, {"type": "null"}]}, None),
        ("Alice", {"anyOf": [{"type": "string"}, {"type": "null"}]}, "Alice"),
        ("none", {"type": "string"}, "none"),  # vLLM would say null
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("2", {"enum": [1, 2, 3]}, 2),
        ("5", {"type": "int"}, 5),  # vLLM's aliases
        ("5", {"description": "no type"}, "5"),
        ("5", None, "5"),  # not in the schema
        ("nil", None, None),
    ],
)
def test_values_are_typed_as_vllm_types_them(raw, schema, value):
    assert minimax_value(raw, schema) == value
    assert type(minimax_value(raw, schema)) is type(value)


def test_parameters_the_schema_does_not_name_stay_strings():
    text = block(invoke("get_weather", location="Paris", extra="7", flag="true"))
    assert extract(text)[1] == [
        ("get_weather", {"location": "Paris", "extra": "7", "flag": "true"})
    ]
    # A tool the request does not have, or no tools at all: every value a string.
    assert extract(block(invoke("other", days="3")))[1] == [("other", {"days": "3"})]
    assert extract(ONE, functions=None)[1] == [
        ("get_weather", {"location": "San Francisco, CA", "days": "3", "detailed": "true"})
    ]


def test_a_key_twice_keeps_the_first():
    text = block(invoke("get_weather", location="a").replace("</invoke>", "") + "</invoke>")
    text = text.replace("</invoke>", '<parameter name="location">b</parameter></invoke>')
    assert extract(text)[1] == [("get_weather", {"location": "a"})]


# Broken before a call's name is complete: streamed, nothing was sent as a call.
BAD_EARLY = [
    "<minimax:tool_call>\n</minimax:tool_call>",  # an empty block
    "<minimax:tool_call>\nhello\n</minimax:tool_call>",  # text, no call
    "<minimax:tool_call><invoke name=>\n</invoke></minimax:tool_call>",  # no name
    '<minimax:tool_call><invoke name="two\nlines"></invoke></minimax:tool_call>',
    '<minimax:tool_call><invoke name="get_wea',  # cut in the name
    "<minimax:tool_call>",  # cut before a call
    invoke("get_time").strip(),  # an invoke outside a block is text, as in vLLM
]
# Broken after it: the streamed call stays sent (a stream cannot take it back).
BAD_LATE = [
    '<minimax:tool_call><invoke name="f"><parameter name="">x</parameter></invoke>'
    "</minimax:tool_call>",
    '<minimax:tool_call><invoke name="f"><parameter name="x">cut',  # cut in a value
    '<minimax:tool_call><invoke name="f"><parameter name="x',  # cut in a parameter's name
]


@pytest.mark.parametrize("bad", BAD_EARLY + BAD_LATE)
def test_malformed_or_cut_blocks_are_content(bad):
    assert extract(bad) == (bad.strip(), [])
    plan = ToolPlan(parser=get_tool_parser("minimax_m2", FUNCTIONS))
    message, finish = plan.message(bad, "stop")
    assert message == {"role": "assistant", "content": bad} and finish == "stop"
    if bad in BAD_EARLY:
        assert_stream_assembles(bad, plan)
    else:
        assert _assemble(bad, list(bad), plan)["content"] == bad  # no crash; all of it


def test_text_in_a_block_that_is_no_tag_is_skipped():
    text = (
        "<minimax:tool_call>\nhello\n"
        + invoke("get_weather", location="Paris").replace("</invoke>", "stray\n</invoke>")
        + "and more</minimax:tool_call>"
    )
    assert extract(text) == (None, [("get_weather", {"location": "Paris"})])
    plan = ToolPlan(parser=get_tool_parser("minimax_m2", FUNCTIONS))
    assert_stream_assembles(text, plan)


def test_an_invoke_left_open_ends_with_its_block():
    text = '<minimax:tool_call><invoke name="get_time"></minimax:tool_call>\nThen text.'
    assert extract(text) == ("Then text.", [("get_time", {})])


def test_a_bad_block_next_to_a_good_one():
    bad = "<minimax:tool_call>\n</minimax:tool_call>"
    assert extract(ONE + "\n" + bad) == (bad, extract(ONE)[1])


def test_cut_after_a_whole_parameter_or_call_holds():
    cut = ONE[: ONE.index("</parameter>") + len("</parameter>")]
    assert extract(cut)[1] == [("get_weather", {"location": "San Francisco, CA"})]
    cut = TWO[: TWO.index("</invoke>") + len("</invoke>")]
    assert extract(cut)[1] == [("get_weather", {"location": "Paris", "units": {"t": "C"}})]


def test_every_cut_point_is_safe_and_only_grows():
    assert_readings_only_grow(get_tool_parser("minimax_m2", FUNCTIONS), TWO)


@pytest.mark.parametrize(
    "text",
    [
        ONE,
        TWO,
        TWO + "\nDone.",
        "No call: a < b, <minimax and <minimax:tool is text.",
        "The user wants Paris.</think>\n\n" + TWO,
        "<think>Which city?</think>" + ONE,
    ],
)
@pytest.mark.parametrize("reasoning", [None, "minimax_m2", "minimax_m2_append_think"])
def test_stream_assembles_to_the_message(text, reasoning):
    """A character at a time, whole, and in random cuttings (through tags)."""
    parser = get_reasoning_parser(reasoning) if reasoning else None
    plan = ToolPlan(parser=get_tool_parser("minimax_m2", FUNCTIONS), reasoning=parser)
    want = assert_stream_assembles(text, plan)
    all_reasoning = reasoning == "minimax_m2" and "</think>" not in text  # never ended
    assert len(want) == (0 if all_reasoning else text.count("<invoke"))


def test_stream_deltas_in_chunks_that_cut_tags():
    plan = ToolPlan(parser=get_tool_parser("minimax_m2", FUNCTIONS))
    streamer = plan.streamer()
    cut = TWO.index("<minimax") + 5
    pieces = [TWO[:cut], TWO[cut : cut + 30], TWO[cut + 30 : -3], TWO[-3:]]
    deltas = [streamer.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert deltas[0] == {"content": "Let me check both."}  # "<mini" held back
    assert "content" not in deltas[1] and "tool_calls" not in deltas[1]
    first = deltas[2]["tool_calls"]
    assert [c["index"] for c in first] == [0, 1]
    assert first[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"location": "Paris", "units": {"t": "C"}}',
    }
    assert first[0]["type"] == "function" and first[0]["id"].startswith("call_")
    assert first[1]["function"] == {"name": "get_time", "arguments": "{}"}
    assert deltas[3] == {}
    got = _assemble(TWO, pieces, plan)
    assert got["content"] == "Let me check both."


def test_streamed_arguments_grow_a_parameter_at_a_time():
    parser = get_tool_parser("minimax_m2", FUNCTIONS)
    seen = []
    for i in range(len(ONE) + 1):
        calls = parser.extract(ONE[:i], final=False).calls
        if calls and (not seen or seen[-1] != (calls[0].name, calls[0].arguments)):
            seen.append((calls[0].name, calls[0].arguments))
    assert seen == [
        ("get_weather", "{"),
        ("get_weather", '{"location": "San Francisco, CA"'),
        ("get_weather", '{"location": "San Francisco, CA", "days": 3'),
        ("get_weather", '{"location": "San Francisco, CA", "days": 3, "detailed": true'),
        ("get_weather", '{"location": "San Francisco, CA", "days": 3, "detailed": true}'),
    ]


# -- reasoning ------------------------------------------------------------------------------
@pytest.mark.parametrize("opened", ["", "<think>", "<think>\n"])
def test_minimax_m2_reasoning_with_or_without_the_start_tag(opened):
    parser = get_reasoning_parser("minimax_m2")
    out = parser.extract(opened + "Plan it.\n</think>\n\nAnswer", final=True)
    assert (out.reasoning, out.content, out.ended) == ("Plan it.\n", "Answer", True)
    # Cut before </think>: all reasoning; streamed, a partial tag is held back.
    assert parser.extract(opened + "Still thinking", final=True).reasoning == "Still thinking"
    out = parser.extract(opened + "Still thinking</thi", final=False)
    assert (out.reasoning, out.content, out.ended) == ("Still thinking", "", False)
    assert parser.end_of_reasoning == "</think>"


def test_minimax_m2_reasoning_leaves_the_calls_to_the_tool_parser():
    out = get_reasoning_parser("minimax_m2").extract("Need weather.</think>\n" + ONE, True)
    assert out.reasoning == "Need weather." and out.content == ONE


def test_append_think_puts_everything_in_the_content():
    parser = get_reasoning_parser("minimax_m2_append_think")
    out = parser.extract("Plan it.\n</think>\n\nAnswer", final=True)
    assert (out.reasoning, out.content) == (None, "<think>Plan it.\n</think>\n\nAnswer")
    # The model's own <think>: not doubled.
    out = parser.extract("<think>Plan it.</think>Answer", final=True)
    assert out.content == "<think>Plan it.</think>Answer"
    # Streamed: what may be the model's own tag waits; the rest grows.
    assert parser.extract("<thi", final=False).content == ""
    assert parser.extract("<thi", final=True).content == "<think><thi"
    assert parser.extract("Pl", final=False).content == "<think>Pl"
    assert parser.end_of_reasoning == "</think>"


def test_append_think_message_keeps_the_block_and_reads_the_calls():
    plan = ToolPlan(
        parser=get_tool_parser("minimax_m2", FUNCTIONS),
        reasoning=get_reasoning_parser("minimax_m2_append_think"),
    )
    message, finish = plan.message("Paris it is.</think>\n\n" + ONE, "stop")
    assert message["content"] == "<think>Paris it is.</think>" and "reasoning" not in message
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert finish == "tool_calls"


# -- end to end through the chat endpoint, over test_harmony's scripted engine ------------
MARKERS = ["<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def minimax_tokenizer(tmp_path_factory):
    """The embedded tokenizer with MiniMax's tags as special tokens (the worst case)."""
    import shutil

    from transformers import AutoTokenizer

    from vllm.config import DEFAULT_MODEL
    from vllm.model_executor.model_loader import resolve_model

    folder = tmp_path_factory.mktemp("minimax_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{resolve_model(DEFAULT_MODEL)}/{name}", folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    return tokenizer


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reasoning", ["minimax_m2", "minimax_m2_append_think"])
def test_chat_endpoint_reads_minimax_calls(minimax_tokenizer, stream, reasoning):
    from tests.entrypoints.openai.test_harmony import serve
    from vllm.entrypoints.openai.tool_calling import ToolCallingConfig

    config = ToolCallingConfig(
        enable_auto_tool_choice=True, tool_call_parser="minimax_m2", reasoning_parser=reasoning
    )
    text = "Paris, three days.</think>\n\n" + block(
        invoke("get_weather", location="Paris", days="3")
    )
    body = {"tools": [{"type": "function", "function": WEATHER}], "stream": stream}
    out, seen = serve(minimax_tokenizer, None, text, body, config=config)
    assert seen["params"].skip_special_tokens is False  # the markers reach the parser
    want = {"name": "get_weather", "arguments": '{"location": "Paris", "days": 3}'}
    appended = reasoning == "minimax_m2_append_think"
    thought = "" if appended else "Paris, three days."
    content = "<think>Paris, three days.</think>" if appended else ""
    if stream:
        deltas = [e["choices"][0]["delta"] for e in out if e["choices"]]
        pieces = [p for d in deltas for p in d.get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "get_weather"
        assert "".join(p["function"]["arguments"] for p in pieces) == want["arguments"]
        assert "".join(d.get("reasoning", "") for d in deltas) == thought
        assert "".join(d.get("content") or "" for d in deltas) == content
        assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"
    else:
        message = out["choices"][0]["message"]
        assert message["tool_calls"][0]["function"] == want
        assert message.get("reasoning") == (thought or None)
        assert message["content"] == (content or None)
        assert out["choices"][0]["finish_reason"] == "tool_calls"
