"""Anthropic's MCP connector on /v1/messages: mcp_servers and mcp_toolset tools resolved
against the configured servers (a fake tool server), the blocks the loop adds, how they
read back as chat and stream; then end to end (``slow``) with a real MCP server and the
official anthropic client."""

from __future__ import annotations

import asyncio
import json

import pytest
from anthropic.types.beta import BetaMessage, BetaRawMessageStreamEvent
from pydantic import TypeAdapter, ValidationError

from vllm.entrypoints.anthropic.mcp import (
    _McpBlockEvents,
    as_mcp_blocks,
    list_tools,
    resolve,
    run_call,
)
from vllm.entrypoints.anthropic.protocol import MessagesRequest, to_chat
from vllm.exceptions import VLLMValidationError

from ..openai.test_responses_mcp import FakeToolServer as _FakeToolServer
from ..openai.test_tool_calling_e2e import MODEL

URL = "http://127.0.0.1:9/mcp"
EVENT = TypeAdapter(BetaRawMessageStreamEvent)


class FakeToolServer(_FakeToolServer):
    """Also counts its listings."""

    listed = 0

    async def list_tools(self, server, headers=None):
        self.listed += 1
        return await super().list_tools(server, headers)


def request(**kw) -> MessagesRequest:
    body = {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Hi"}],
        "mcp_servers": [{"type": "url", "url": URL, "name": "calc"}],
    }
    return MessagesRequest.model_validate({**body, **kw})


def connect(req: MessagesRequest, server=None, headers=None, output=False, taken=()):
    server = server or FakeToolServer()
    connector = resolve(req, server, headers or {})
    asyncio.run(list_tools(connector, server, set(taken), output))
    return connector


def names(connector) -> list[str]:
    return [f["function"]["name"] for f in connector.functions]


def param_of(exc: pytest.ExceptionInfo) -> str | None:
    err = exc.value
    if isinstance(err, ValidationError):
        err = err.errors()[0]["ctx"]["error"]
    return err.param


def toolset(**kw):
    return {"type": "mcp_toolset", "mcp_server_name": "calc", **kw}


# -- resolution -----------------------------------------------------------------------------
def test_a_server_and_its_tools_become_functions():
    connector = connect(request())
    assert names(connector) == ["add", "wipe"] and set(connector.routes) == {"add", "wipe"}
    assert connector.functions[0]["function"]["description"] == "Add numbers"
    assert connector.listings == []  # only with the mcp-client-2026-09-15 beta


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"tools": [toolset()]}, ["add", "wipe"]),
        ({"tools": [toolset(default_config={"enabled": False},
                            configs={"add": {"enabled": True}})]}, ["add"]),  # fmt: skip
        ({"tools": [toolset(configs={"add": {"enabled": False, "defer_loading": False}})]},
         ["wipe"]),  # fmt: skip
        ({"mcp_servers": [{"type": "url", "url": URL, "name": "calc",
                           "tool_configuration": {"allowed_tools": ["wipe"]}}]}, ["wipe"]),
        ({"mcp_servers": [{"type": "url", "url": URL, "name": "calc",
                           "tool_configuration": {"enabled": False}}]}, []),
    ],
)  # fmt: skip
def test_toolsets_and_tool_configuration_enable_tools(kw, expected):
    assert names(connect(request(**kw))) == expected


def test_the_token_is_a_bearer_header_and_calls_run():
    server = FakeToolServer()
    spec = {"type": "url", "url": URL, "name": "calc", "authorization_token": "tok"}
    connector = connect(request(mcp_servers=[spec]), server)
    assert server.headers == {"Authorization": "Bearer tok"}
    blocks = as_mcp_blocks(
        [
            {"type": "text", "text": "Let me add."},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}},
            {"type": "tool_use", "id": "toolu_2", "name": "mine", "input": {}},
        ],
        connector,
    )
    assert [b["type"] for b in blocks] == ["text", "mcp_tool_use", "tool_use"]
    assert blocks[1]["server_name"] == "calc"
    result = asyncio.run(run_call(server, connector, blocks[1]))
    assert result == {
        "type": "mcp_tool_result",
        "tool_use_id": "toolu_1",
        "is_error": False,
        "content": [{"type": "text", "text": "5"}],
    }
    assert server.calls == [("calc", "add", {"a": 2, "b": 3}, {"Authorization": "Bearer tok"})]
    failed = asyncio.run(run_call(server, connector, {**blocks[1], "name": "wipe"}))
    assert failed["is_error"] is True and failed["content"][0]["text"]


def test_listings_pinned_or_sent_back_are_not_fetched_and_fetched_ones_are_output():
    server = FakeToolServer()
    pinned = [{"name": "mul", "input_schema": {"type": "object"}, "description": "x*y"}]
    connector = connect(request(tools=[toolset(tools=pinned)]), server, output=True)
    assert names(connector) == ["mul"] and server.listed == 0 and connector.listings == []
    back = {"type": "mcp_tool_listing", "mcp_server_name": "calc", "tools": pinned}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [back, {"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "Multiply"},
    ]
    connector = connect(request(messages=messages), server, output=True)
    assert names(connector) == ["mul"] and server.listed == 0
    connector = connect(request(), server, output=True)
    assert server.listed == 1
    (listing,) = connector.listings
    assert listing["type"] == "mcp_tool_listing" and listing["mcp_server_name"] == "calc"
    assert [t["name"] for t in listing["tools"]] == ["add", "wipe"]


@pytest.mark.parametrize(
    "kw, param, words",
    [
        ({"mcp_servers": [{"type": "url", "url": "http://evil.example/mcp", "name": "x"}]},
         "mcp_servers", "no MCP server"),
        ({"tools": [toolset(mcp_server_name="other")]}, "tools", "mcp_server_name must be"),
        ({"tools": [toolset(), toolset()]}, "tools", "second mcp_toolset"),
        ({"tools": [toolset(default_config={"defer_loading": True})]}, "tools", "defer_loading"),
        ({"tools": [toolset(bogus=1)]}, "tools", "an mcp_toolset takes"),
        ({"tools": [toolset()], "mcp_servers": [{"type": "url", "url": URL, "name": "calc",
                                                "tool_configuration": {"enabled": True}}]},
         "mcp_servers", "configure its tools there"),
    ],
)  # fmt: skip
def test_what_cannot_be_served_is_a_400_naming_the_field(kw, param, words):
    with pytest.raises(VLLMValidationError, match=words) as e:
        resolve(request(**kw), FakeToolServer(), {})
    assert e.value.param == param


def test_no_tool_server_and_name_clashes_are_400s():
    with pytest.raises(VLLMValidationError, match="--tool-server") as e:
        resolve(request(), None, {})
    assert e.value.param == "mcp_servers"
    with pytest.raises(VLLMValidationError, match="given twice"):
        connect(request(), taken={"add"})


@pytest.mark.parametrize(
    "servers",
    [
        [{"type": "url", "url": URL}],
        [{"type": "sse", "url": URL, "name": "calc"}],
        [{"type": "url", "url": URL, "name": "calc", "bogus": 1}],
        [
            {
                "type": "url",
                "url": URL,
                "name": "calc",
                "tool_configuration": {"allowed_tools": "add"},
            }
        ],
        [{"type": "url", "url": URL, "name": "calc"}, {"type": "url", "url": URL, "name": "calc"}],
    ],
)
def test_malformed_mcp_servers_are_400s(servers):
    with pytest.raises((VLLMValidationError, ValidationError)) as e:
        request(mcp_servers=servers)
    assert param_of(e) == "mcp_servers"


def test_a_toolset_without_mcp_servers_is_a_400_naming_tools():
    from vllm.entrypoints.anthropic.protocol import chat_tools

    with pytest.raises(VLLMValidationError, match="has none") as e:
        chat_tools([toolset()])
    assert e.value.param == "tools"
    assert chat_tools([toolset()], toolsets=True) == []


# -- read back ------------------------------------------------------------------------------
def test_mcp_blocks_sent_back_read_as_calls_and_results():
    use = {"type": "mcp_tool_use", "id": "t1", "name": "add", "server_name": "calc",
           "input": {"a": 1}}  # fmt: skip
    result = {"type": "mcp_tool_result", "tool_use_id": "t1", "is_error": False,
              "content": [{"type": "text", "text": "1"}]}  # fmt: skip
    listing = {"type": "mcp_tool_listing", "mcp_server_name": "calc", "tools": []}
    messages = [
        {"role": "user", "content": "Add"},
        {"role": "assistant", "content": [
            listing, {"type": "text", "text": "Adding."}, use, result,
            {"type": "text", "text": "It is 1."},
        ]},
        {"role": "user", "content": [{**result, "tool_use_id": "t2", "is_error": True}]},
    ]  # fmt: skip
    chat = to_chat(request(messages=messages)).messages
    call = {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    assert chat == [
        {"role": "user", "content": "Add"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t1", "content": "1"},
        {"role": "assistant", "content": "It is 1."},
        {"role": "tool", "tool_call_id": "t2", "content": "1", "is_error": True},
    ]


# -- streaming ------------------------------------------------------------------------------
def test_an_mcp_call_streams_as_anthropics_blocks():
    connector = connect(request())
    events = _McpBlockEvents(connector)
    piece = {"index": 0, "id": "toolu_1", "function": {"name": "add", "arguments": '{"a": 2'}}
    chunks = events.delta({"content": "Adding."})
    chunks += events.delta({"tool_calls": [piece]})
    chunks += events.delta({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]})
    chunks += events.close()
    generated = events.generated()
    assert generated == [
        {"type": "text", "text": "Adding."},
        {"type": "mcp_tool_use", "id": "toolu_1", "name": "add", "server_name": "calc",
         "input": {"a": 2}},
    ]  # fmt: skip
    assert not events.called  # an MCP call: not the client's to run
    result = {"type": "mcp_tool_result", "tool_use_id": "toolu_1", "is_error": False,
              "content": [{"type": "text", "text": "2"}]}  # fmt: skip
    chunks += events.whole(result)
    events.new_generation()
    chunks += events.delta({"content": "It is 2."}) + events.close()
    parsed = [EVENT.validate_python(json.loads(c.split("\n")[1][6:])) for c in chunks]
    kinds = [(e.type, getattr(e, "index", None)) for e in parsed]
    assert kinds == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
        ("content_block_stop", 1), ("content_block_start", 2), ("content_block_stop", 2),
        ("content_block_start", 3), ("content_block_delta", 3), ("content_block_stop", 3),
    ]  # fmt: skip
    assert parsed[3].content_block.type == "mcp_tool_use"
    assert parsed[4].delta.type == "input_json_delta"
    assert parsed[7].content_block.type == "mcp_tool_result"


# -- end to end -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(mcp_served):
    return mcp_served  # tests/entrypoints/conftest.py


@pytest.fixture(scope="module")
def client(served):
    import anthropic

    return anthropic.Anthropic(base_url=served.base, api_key="unused", max_retries=0)


def create(client, mcp_server, **kw):
    kw = {
        "model": MODEL,
        "max_tokens": 48,
        "messages": [{"role": "user", "content": "What is 2 plus 3? Use the add tool."}],
        "mcp_servers": [{"type": "url", "url": mcp_server.url, "name": "calc"}],
        "tools": [{"type": "mcp_toolset", "mcp_server_name": "calc",
                   "default_config": {"enabled": False},
                   "configs": {"add": {"enabled": True}}}],
        "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        "betas": ["mcp-client-2025-11-20"],
        "extra_body": {"temperature": 0},
        **kw,
    }  # fmt: skip
    return client.beta.messages.create(**kw)


@pytest.mark.slow
def test_the_server_runs_the_models_mcp_calls_and_answers(client, mcp_server):
    msg = create(client, mcp_server)
    assert isinstance(msg, BetaMessage)
    kinds = [b.type for b in msg.content]
    use, result = (
        msg.content[kinds.index("mcp_tool_use")],
        msg.content[kinds.index("mcp_tool_result")],
    )
    assert kinds.index("mcp_tool_use") < kinds.index("mcp_tool_result")
    assert use.name == "add" and use.server_name == "calc"
    assert result.tool_use_id == use.id and result.is_error is False
    expected = use.input.get("a", 0) + use.input.get("b", 0)
    assert result.content[0].text == str(expected)
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    # The conversation goes on with the blocks sent back.
    messages = [
        {"role": "user", "content": "What is 2 plus 3? Use the add tool."},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": "Thanks."},
    ]
    again = create(client, mcp_server, messages=messages, tool_choice={"type": "none"},
                   max_tokens=8)  # fmt: skip
    assert [b.type for b in again.content] == ["text"]


@pytest.mark.slow
def test_a_streamed_mcp_message_has_anthropics_events(client, mcp_server):
    with client.beta.messages.stream(
        model=MODEL,
        max_tokens=48,
        messages=[{"role": "user", "content": "What is 2 plus 3? Use the add tool."}],
        mcp_servers=[{"type": "url", "url": mcp_server.url, "name": "calc"}],
        tools=[{"type": "mcp_toolset", "mcp_server_name": "calc"}],
        tool_choice={"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        betas=["mcp-client-2026-09-15"],
        extra_body={"temperature": 0},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [b.type for b in final.content]
    assert kinds[:3] == ["mcp_tool_listing", "mcp_tool_use", "mcp_tool_result"], kinds
    assert final.content[1].input and final.content[2].tool_use_id == final.content[1].id
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta"
               for e in events)  # fmt: skip
    assert final.usage.output_tokens > 0


@pytest.mark.slow
def test_an_unknown_server_is_a_400_listing_the_configured_ones(client, mcp_server):
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="--tool-server") as e:
        evil = {"type": "url", "url": "http://evil.example/mcp", "name": "calc"}
        create(client, mcp_server, mcp_servers=[evil])
    assert mcp_server.url.split("://")[1] in str(e.value)


@pytest.mark.parametrize("last, expected", [(None, True), (True, True), (False, False)])
def test_every_generation_pins_the_job_while_calls_run(last, expected):
    from types import SimpleNamespace

    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.cli_args import FrontendArgs
    from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL

    serving = AnthropicServingMessages(SimpleNamespace(args=FrontendArgs()))
    req = request(job_id="job-1", is_last_step=last, tools=[toolset()])
    fn = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    chat = asyncio.run(serving._chat_request(req, {}, None, [fn], "auto"))
    assert chat.job_id == "job-1" and chat.is_last_step is False
    assert bool((chat.vllm_xargs or {}).get(LAST_UNLESS_TOOL_CALL)) is expected
    assert [t["function"]["name"] for t in chat.tools] == ["add"] and chat.tool_choice == "auto"
