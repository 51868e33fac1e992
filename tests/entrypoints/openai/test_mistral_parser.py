"""``--tool-call-parser mistral``: both of Mistral's call formats, streaming that adds up
to the whole message, the special tokens kept in the request's text, and the 9-character
alphanumeric call ids Mistral's chat templates accept when the history comes back."""

from __future__ import annotations

import json
import re

import pytest

from tests.entrypoints.openai.test_tool_choice import BASH, WEATHER, plan
from tests.entrypoints.openai.test_tool_parsers import assemble, calls
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig, ToolPlan
from vllm.entrypoints.openai.tool_parsers import get_tool_parser

MISTRAL = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="mistral")
V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
V11_TWO = V11 + '[TOOL_CALLS]bash[ARGS]{"command": "ls -la"}'
LIST = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.parametrize(
    "text, content, found",
    [
        (V11, None, [("get_weather", {"city": "Paris"})]),
        ("Let me look. " + V11_TWO, "Let me look.",
         [("get_weather", {"city": "Paris"}), ("bash", {"command": "ls -la"})]),
        (LIST, None, [("get_weather", {"city": "Paris"})]),
        ('[TOOL_CALLS]bash[CALL_ID]a1B2c3D4e[ARGS]{"command": "ls"}', None,
         [("bash", {"command": "ls"})]),
        ("Paris is sunny today.", "Paris is sunny today.", []),
        ('[TOOL_CALLS]bash[ARGS]{"command": ', '[TOOL_CALLS]bash[ARGS]{"command":', []),  # cut
        ("[TOOL_CALLS]bash[ARGS]not json", "[TOOL_CALLS]bash[ARGS]not json", []),
        ("[TOOL_CALLS]bash", "[TOOL_CALLS]bash", []),
    ],
)  # fmt: skip
def test_both_formats_and_what_is_not_a_call(text, content, found):
    assert calls("mistral", text) == (content, found)


@pytest.mark.parametrize("text", [V11, "Let me look. " + V11_TWO, LIST, "Plain [TOOL text."])
def test_stream_assembles_to_the_non_streaming_message(text):
    message, _ = ToolPlan(parser=get_tool_parser("mistral")).message(text, "stop")
    want = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])
    ]
    want_content = (message["content"] or "").strip() if want else text.strip()
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    assert assemble("mistral", text, pieces) == (want_content, want)
    assert assemble("mistral", text, list(text)) == (want_content, want)


def test_mistral_requests_keep_special_tokens_and_get_mistral_call_ids():
    auto = plan(MISTRAL, tools=[WEATHER, BASH])
    assert auto.keep_special_tokens and auto.parser is not None
    message, reason = auto.message(V11_TWO, "stop")
    assert reason == "tool_calls"
    ids = [c["id"] for c in message["tool_calls"]]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and len(set(ids)) == 2
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"command": "ls -la"}
    # Guided (required / named) output is plain JSON, but its ids suit the template too.
    named = plan(
        MISTRAL, tools=[BASH], tool_choice={"type": "function", "function": {"name": "bash"}}
    )
    assert not named.keep_special_tokens
    call = named.message('{"name": "bash", "arguments": {}}', "stop")[0]["tool_calls"][0]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"])
    # Other parsers keep OpenAI-style ids and skip special tokens, as before.
    hermes = plan(ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes"),
                  tools=[BASH])  # fmt: skip
    assert not hermes.keep_special_tokens and hermes.call_id().startswith("call_")


def test_a_mistral_request_reaches_the_engine_keeping_special_tokens(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat

    serving = OpenAIServingChat(SimpleNamespace(), "m")

    async def prompt(request, plan):
        return "rendered"

    monkeypatch.setattr(serving, "_prompt", prompt)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [BASH]}
    for config, skip in ((MISTRAL, False), (ToolCallingConfig(), True)):
        serving.tool_config = config
        if config is not MISTRAL:
            body["tool_choice"] = "none"
        _, _, params = asyncio.run(serving._prepare(ChatCompletionRequest(**body)))
        assert params.skip_special_tokens is skip
