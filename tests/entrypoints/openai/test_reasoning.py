"""--reasoning-parser: a thinking model's reasoning apart from its answer (vLLM's
``message.reasoning``, ``delta.reasoning`` and ``usage.completion_tokens_details``).

The parsers on texts; the chat endpoint's own code over a scripted engine (outputs made
from a given text with the embedded tokenizer, whole or token by token), since the 135M
model does not write ``<think>`` tags when asked; and one real server whose every output
is reasoning (DeepSeek-R1's template opens the block, so an output that never closes it
is all reasoning).
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import requests
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from vllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from vllm.entrypoints.openai.protocol_responses import (
    ResponsesRequest,
    items_to_messages,
    normalize_input,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig, ToolPlan
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.reasoning import count_reasoning_tokens, get_reasoning_parser, reasoning_parser_names
from vllm.sampling_params import RequestOutputKind

from ...utils import RemoteServer

CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
TEXTS = [
    "<think>\nTwo and two.\n</think>\n\nThe answer is 4.",
    "Two and two.\n</think>\n\nFour.",  # the template opened the block
    "<think>Still thinking, cut off by max_tokens",
    "Plan: list files.</think>\n" + CALL,
    "Plan: call at once." + CALL,  # qwen3: a call ends the reasoning
    "<think></think>Empty reasoning.",
    "   ",
    "",
]


def test_the_parsers_offered():
    assert set(reasoning_parser_names()) >= {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ToolCallingConfig(reasoning_parser="nope")


@pytest.mark.parametrize(
    ("name", "kwargs", "text", "reasoning", "content"),
    [
        ("deepseek_r1", {}, TEXTS[0], "Two and two.\n", "The answer is 4."),
        ("deepseek_r1", {}, TEXTS[1], "Two and two.\n", "Four."),
        ("deepseek_r1", {}, TEXTS[2], "Still thinking, cut off by max_tokens", ""),
        ("deepseek_r1", {}, TEXTS[4], "Plan: call at once." + CALL, ""),
        ("deepseek_r1", {}, TEXTS[5], "", "Empty reasoning."),
        ("qwen3", {}, TEXTS[0], "Two and two.\n", "The answer is 4."),
        ("qwen3", {}, TEXTS[3], "Plan: list files.", CALL),
        ("qwen3", {}, TEXTS[4], "Plan: call at once.", CALL),
        ("qwen3", {"enable_thinking": False}, TEXTS[0], None, TEXTS[0]),
        ("qwen3", {"enable_thinking": True}, TEXTS[1], "Two and two.\n", "Four."),
    ],
)
def test_final_split(name, kwargs, text, reasoning, content):
    got = get_reasoning_parser(name, kwargs).extract(text, final=True)
    assert (got.reasoning, got.content) == (reasoning, content)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_readings_only_grow_and_end_at_the_final_one(name, text):
    parser = get_reasoning_parser(name)
    assert_readings_grow(parser, text)
    # Nothing that could be a tag is shown before it is known not to be one.
    assert "</thi" not in (parser.extract(TEXTS[0][:30], False).reasoning or "")


def assert_readings_grow(parser, text: str) -> None:
    """Each prefix's reading of ``text`` extends the one before and leads to the final
    reading; once ended, it stays ended."""
    final = parser.extract(text, final=True)
    previous = parser.extract("", final=False)
    for k in range(1, len(text) + 1):
        now = parser.extract(text[:k], final=False)
        assert (now.reasoning or "").startswith(previous.reasoning or "")
        assert now.content.startswith(previous.content)
        assert (final.reasoning or "").startswith(now.reasoning or "")
        assert final.content.startswith(now.content)
        assert now.ended or not previous.ended
        previous = now


def _stream(plan: ToolPlan, text: str, step: int) -> dict:
    """The deltas of ``text`` arriving ``step`` characters at a time, joined per field."""
    streamer = plan.streamer()
    joined: dict = {"reasoning": "", "content": "", "calls": {}}
    for i in range(0, max(len(text), 1), step):
        piece = text[i : i + step]
        delta = streamer.delta(piece, i + step >= len(text))
        joined["reasoning"] += delta.get("reasoning", "")
        joined["content"] += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = joined["calls"].setdefault(call["index"], {"name": None, "arguments": ""})
            entry["name"] = call.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += call["function"]["arguments"]
    return joined


@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_adds_up_to_the_message(text, step, with_tools):
    parser = get_tool_parser("hermes") if with_tools else None
    plan = ToolPlan(parser=parser, reasoning=get_reasoning_parser("qwen3"))
    message, _ = plan.message(text, "stop")
    joined = _stream(plan, text, step)
    assert joined["reasoning"] == (message.get("reasoning") or "")
    assert joined["content"] == (message["content"] or "")
    calls = [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message.get("tool_calls", [])
    ]
    assert [joined["calls"][i] for i in sorted(joined["calls"])] == calls


def test_tool_calls_are_read_from_the_content_only():
    plan = ToolPlan(parser=get_tool_parser("hermes"), reasoning=get_reasoning_parser("qwen3"))
    message, finish = plan.message(TEXTS[3], "stop")
    assert message["reasoning"] == "Plan: list files."
    assert message["content"] is None and finish == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}
    # A call written while reasoning (DeepSeek-R1 does not end reasoning there) is not one.
    plan.reasoning = get_reasoning_parser("deepseek_r1")
    message, finish = plan.message(TEXTS[4], "length")
    assert "tool_calls" not in message and finish == "length"


def test_stream_reasoning_false_sends_it_in_one_piece_once_over():
    plan = ToolPlan(reasoning=get_reasoning_parser("qwen3"), stream_reasoning=False)
    streamer = plan.streamer()
    text = TEXTS[0]
    deltas = [streamer.delta(ch, i == len(text) - 1) for i, ch in enumerate(text)]
    pieces = [d["reasoning"] for d in deltas if "reasoning" in d]
    assert pieces == ["Two and two.\n"]
    first_content = next(i for i, d in enumerate(deltas) if "content" in d)
    assert first_content > next(i for i, d in enumerate(deltas) if "reasoning" in d)


def test_reasoning_tokens_are_those_between_the_tags():
    pieces = ["<think>", "\n", "I", " add", "</think>", "\n\n", "Four", "."]

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    qwen3 = get_reasoning_parser("qwen3")
    ids = list(range(len(pieces)))
    assert count_reasoning_tokens(qwen3, ids, decode) == 2  # "I", " add" (vLLM: 3 with "\n")
    assert count_reasoning_tokens(qwen3, ids[1:], decode) == 2  # the template opened it
    assert count_reasoning_tokens(qwen3, ids[:4], decode) == 2  # never closed
    pieces.append("")  # an EOS, decoded without special tokens
    assert count_reasoning_tokens(qwen3, [*ids[:4], len(pieces) - 1], decode) == 2
    assert count_reasoning_tokens(qwen3, [], decode) == 0
    off = get_reasoning_parser("qwen3", {"enable_thinking": False})
    assert count_reasoning_tokens(off, ids, decode) == 0


def test_an_assistant_turns_reasoning_reaches_the_template_under_both_names():
    for key in ("reasoning", "reasoning_content"):
        message = ChatMessage.model_validate({"role": "assistant", "content": "4", key: "2+2"})
        rendered = message.for_template()
        assert rendered["reasoning"] == rendered["reasoning_content"] == "2+2"


def test_the_switches_are_strict_booleans():
    for field in ("include_reasoning", "separate_reasoning", "stream_reasoning"):
        with pytest.raises(ValueError, match=field):
            ChatCompletionRequest.model_validate(
                {"messages": [{"role": "user", "content": "hi"}], field: "no"}
            )


# -- the chat endpoint over a scripted engine -------------------------------------------
class _ScriptedStream:
    engine_latency_s = None
    prompt_token_ids = [1, 2, 3]

    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    async def aclose(self) -> None:
        pass

    def put(self, item) -> None:
        pass


def _scripted_engine(tokenizer, text: str):
    """An engine whose every request outputs ``text`` (the embedded tokenizer's tokens):
    one final output, or one delta per token when streaming."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    seen: dict = {}

    async def add_request(prompt, params, request_id, **kw):
        seen["params"], seen["prompt"] = params, prompt

        def out(index, piece, token_ids, finish):
            c = CompletionOutput(index, piece, token_ids, finish_reason=finish)
            return RequestOutput(request_id, prompt, [1, 2, 3], [c], finish is not None)

        if params.output_kind != RequestOutputKind.DELTA:
            return _ScriptedStream([out(0, text, ids, "stop")])
        outputs, sent = [], ""
        for k in range(1, len(ids) + 1):
            now = tokenizer.decode(ids[:k])
            outputs.append(
                out(0, now[len(sent) :], ids[k - 1 : k], "stop" if k == len(ids) else None)
            )
            sent = now
        return _ScriptedStream(outputs)

    def apply_chat_template(messages, *args):
        seen["messages"], seen["template_kwargs"] = messages, args[3]
        return "prompt"

    engine = SimpleNamespace(
        add_request=add_request,
        apply_chat_template=apply_chat_template,
        chat_template="{{ messages }}",
        decode=lambda ids, skip=False: tokenizer.decode(ids, skip_special_tokens=skip),
        config=SimpleNamespace(
            cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=True)
        ),
    )
    return engine, seen


def _serve(tokenizer, text: str, body: dict, parser: str | None = "qwen3") -> dict | list:
    engine, _ = _scripted_engine(tokenizer, text)
    serving = OpenAIServingChat(engine, "m")
    serving.tool_config = ToolCallingConfig(reasoning_parser=parser)
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "2+2?"}], **body}
    )

    async def run():
        response = await serving.create_chat_completion(request)
        if not request.stream:
            return json.loads(response.body)
        events = [e async for e in response.body_iterator]
        return [json.loads(e[6:]) for e in events if e != "data: [DONE]\n\n"]

    return asyncio.run(run())


def test_chat_response_has_the_reasoning_and_its_token_count(tokenizer):
    body = _serve(tokenizer, TEXTS[0], {})
    message = body["choices"][0]["message"]
    assert message["reasoning"] == "Two and two.\n"
    assert message["content"] == "The answer is 4."
    # The embedded tokenizer writes each tag in several tokens: the start tag's are left
    # out, the end tag's last token too.
    expected = len(tokenizer.encode("Two and two.\n</think", add_special_tokens=False))
    details = body["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] in (expected - 1, expected, expected + 1)
    assert 0 < details["reasoning_tokens"] < body["usage"]["completion_tokens"]


def test_chat_stream_adds_up_to_the_response(tokenizer):
    whole = _serve(tokenizer, TEXTS[0], {})
    events = _serve(
        tokenizer, TEXTS[0], {"stream": True, "stream_options": {"include_usage": True}}
    )
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Two and two.\n"
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."
    assert events[-1]["usage"] == whole["usage"]


def test_include_reasoning_false_drops_it(tokenizer):
    body = _serve(tokenizer, TEXTS[0], {"include_reasoning": False})
    message = body["choices"][0]["message"]
    assert "reasoning" not in message and message["content"] == "The answer is 4."
    events = _serve(tokenizer, TEXTS[0], {"stream": True, "include_reasoning": False})
    assert not any("reasoning" in e["choices"][0]["delta"] for e in events)


def test_dropped_reasoning_takes_its_logprobs_and_token_ids_along(tokenizer):
    # They would spell the reasoning out: withheld, as vLLM does.
    ask = {"return_token_ids": True, "logprobs": True}
    shown = _serve(tokenizer, TEXTS[0], ask)["choices"][0]
    assert shown["token_ids"] and "logprobs" in shown
    hidden = _serve(tokenizer, TEXTS[0], {**ask, "include_reasoning": False})["choices"][0]
    assert hidden["token_ids"] is None and hidden["logprobs"] is None
    events = _serve(tokenizer, TEXTS[0], {**ask, "include_reasoning": False, "stream": True})
    for e in events:
        assert "token_ids" not in e["choices"][0] and e["choices"][0]["logprobs"] is None


def test_separate_reasoning_false_and_no_parser_leave_the_text_as_content(tokenizer):
    for body, parser in (({"separate_reasoning": False}, "qwen3"), ({}, None)):
        out = _serve(tokenizer, TEXTS[0], body, parser)
        assert out["choices"][0]["message"] == {"role": "assistant", "content": TEXTS[0]}
    out = _serve(tokenizer, TEXTS[0], {"separate_reasoning": False})
    assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert "completion_tokens_details" not in _serve(tokenizer, TEXTS[0], {}, None)["usage"]


def test_thinking_switched_off_is_all_content(tokenizer):
    body = _serve(tokenizer, "Four.", {"chat_template_kwargs": {"enable_thinking": False}})
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Four."}


def _serve_seen(tokenizer, text: str, body: dict) -> tuple[dict, dict]:
    engine, seen = _scripted_engine(tokenizer, text)
    serving = OpenAIServingChat(engine, "m")
    serving.tool_config = ToolCallingConfig(reasoning_parser="qwen3")
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "2+2?"}], **body}
    )
    response = asyncio.run(serving.create_chat_completion(request))
    return json.loads(response.body), seen


BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


def test_a_guided_output_holds_after_the_reasoning(tokenizer):
    text = 'Two and two.</think>\n{"sum": 4}'
    body, seen = _serve_seen(tokenizer, text, {"response_format": {"type": "json_object"}})
    assert seen["params"].structured_outputs.after_reasoning == "</think>"
    message = body["choices"][0]["message"]
    assert message["reasoning"] == "Two and two." and json.loads(message["content"]) == {"sum": 4}
    # Thinking switched off: the grammar holds from the first token.
    off = {
        "response_format": {"type": "json_object"},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    body, seen = _serve_seen(tokenizer, '{"sum": 4}', off)
    assert seen["params"].structured_outputs.after_reasoning is None
    assert body["choices"][0]["message"] == {"role": "assistant", "content": '{"sum": 4}'}


def test_a_required_tool_call_after_the_reasoning(tokenizer):
    text = 'I should list.</think>\n[{"name": "bash", "arguments": {"command": "ls"}}]'
    body, seen = _serve_seen(tokenizer, text, {"tools": [BASH], "tool_choice": "required"})
    assert seen["params"].structured_outputs.after_reasoning == "</think>"
    choice = body["choices"][0]
    assert choice["message"]["reasoning"] == "I should list."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "bash"
    assert choice["finish_reason"] == "tool_calls"


# -- /v1/responses ------------------------------------------------------------------------
def _respond(serving: OpenAIServingResponses, body: dict) -> dict | list:
    request = ResponsesRequest.model_validate(body)

    async def run():
        response = await serving.create_response(request)
        if not request.stream:
            return json.loads(response.body)
        events = []
        async for e in response.body_iterator:
            events.append(json.loads(e.split("data: ", 1)[1]))
        return events

    return asyncio.run(run())


def _responses(tokenizer, text: str):
    engine, seen = _scripted_engine(tokenizer, text)
    chat = OpenAIServingChat(engine, "m")
    chat.tool_config = ToolCallingConfig(reasoning_parser="qwen3")
    return OpenAIServingResponses(chat), seen


def test_responses_output_a_reasoning_item_before_the_message(tokenizer):
    serving, _ = _responses(tokenizer, TEXTS[0])
    body = _respond(serving, {"input": "2+2?"})
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Two and two.\n"}]
    assert reasoning["summary"] == []
    assert message["content"][0]["text"] == "The answer is 4."
    chat = _serve(tokenizer, TEXTS[0], {})
    details = chat["usage"]["completion_tokens_details"]
    assert body["usage"]["output_tokens_details"] == details
    parsed = Response.model_validate(body)  # the openai package's own type
    assert parsed.output[0].content[0].text == "Two and two.\n"


def test_responses_stream_reasoning_events_then_the_text(tokenizer):
    serving, _ = _responses(tokenizer, TEXTS[0])
    events = _respond(serving, {"input": "2+2?", "stream": True})
    kinds = [e["type"] for e in events]
    first = kinds.index("response.reasoning_text.delta")
    assert kinds[first - 2 : first] == ["response.output_item.added", "response.content_part.added"]
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done : done + 3] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert done < kinds.index("response.output_text.delta")
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == events[done]["text"] == "Two and two.\n"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:  # each in the openai package's own event types
        TypeAdapter(ResponseStreamEvent).validate_python(event)
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    whole = _respond(_responses(tokenizer, TEXTS[0])[0], {"input": "2+2?"})
    assert final["usage"] == whole["usage"]


def test_reasoning_items_go_back_as_the_next_assistant_turns_reasoning(tokenizer):
    serving, seen = _responses(tokenizer, TEXTS[0])
    first = _respond(serving, {"input": "2+2?"})
    _respond(serving, {"input": "And 3+3?", "previous_response_id": first["id"]})
    user, assistant, again = seen["messages"]
    assert assistant["role"] == "assistant" and assistant["reasoning_content"] == "Two and two.\n"
    assert again["content"] == "And 3+3?"


def test_reasoning_input_items():
    items = normalize_input(
        [
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "greet"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "dangling"}]},
            {"role": "user", "content": "bye"},
        ]
    )
    messages = items_to_messages(items)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[1]["reasoning"] == "greet" and messages[1]["tool_calls"]
    assert not any("dangling" in str(m) for m in messages)


@pytest.mark.slow
def test_server_returns_reasoning_when_the_block_is_never_closed(tmp_path):
    server = RemoteServer("--reasoning-parser", "deepseek_r1", log_path=str(tmp_path / "log"))
    try:
        client = server.client()
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=12,
            temperature=0,
        )
        message = reply.choices[0].message
        assert message.content is None
        assert message.reasoning and message.reasoning == message.reasoning.lstrip()
        details = reply.usage.completion_tokens_details
        eos = 1 if reply.choices[0].finish_reason == "stop" else 0  # not reasoning
        assert details.reasoning_tokens == reply.usage.completion_tokens - eos
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        deltas = [c.choices[0].delta for c in stream if c.choices]
        assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
        assert not any(d.content for d in deltas)
        # A guided request: the grammar waits for the end of a reasoning that never comes.
        guided = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=12,
            temperature=0,
            response_format={"type": "json_object"},
        )
        assert guided.choices[0].finish_reason == "length"
        assert guided.choices[0].message.content is None and guided.choices[0].message.reasoning
        # With a thinking budget the reasoning ends after 4 tokens (its end tag forced),
        # and the answer, held to the grammar from there, is JSON.
        budgeted = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is 2+2?"}],
            max_tokens=40,
            temperature=0,
            response_format={"type": "json_object"},
            extra_body={"thinking_token_budget": 4},
        )
        choice = budgeted.choices[0]
        assert choice.message.reasoning == message.reasoning[: len(choice.message.reasoning)]
        # The usage counts up to the tag's last token (with a one-token tag, as in thinking
        # models' vocabularies, exactly the budget); here the tag is several tokens.
        tag = requests.post(
            server.base + "/tokenize", json={"prompt": "</think>", "add_special_tokens": False}
        ).json()["count"]
        assert budgeted.usage.completion_tokens_details.reasoning_tokens == 4 + tag - 1
        if choice.finish_reason == "stop":
            json.loads(choice.message.content)
        else:
            assert choice.message.content.lstrip().startswith("{")
    finally:
        server.stop()


def test_responses_reasoning_effort_reaches_the_template_as_chat_s_does(tokenizer):
    serving, seen = _responses(tokenizer, TEXTS[0])
    body = _respond(serving, {"input": "2+2?", "reasoning": {"effort": "low"}})
    assert seen["template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}
    assert body["reasoning"] == {"effort": "low", "summary": None}
    _respond(serving, {"input": "2+2?", "reasoning": {"effort": "none"}})
    assert seen["template_kwargs"] == {"reasoning_effort": "none", "enable_thinking": False}
    _respond(serving, {"input": "2+2?"})
    assert seen["template_kwargs"] is None
