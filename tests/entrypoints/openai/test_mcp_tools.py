"""The MCP client behind the Responses API's mcp tools (vllm/entrypoints/openai/
mcp_tools.py) against real MCP servers (mcp_test_server.py): one over SSE, one over
streamable HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

pytest.importorskip("mcp")

from tests.entrypoints.openai.mcp_test_server import (  # noqa: E402
    INSTRUCTIONS,
    start_mcp_test_server,
)
from vllm.entrypoints.openai.mcp_tools import MCPToolServer  # noqa: E402
from vllm.entrypoints.utils import get_open_port  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def sse_server():
    with start_mcp_test_server("sse", name="calc") as server:
        yield server


@pytest.fixture(scope="module")
def http_server():
    with start_mcp_test_server("streamable-http", name="calc_http") as server:
        yield server


@pytest.fixture(scope="module")
def tools(sse_server, http_server) -> MCPToolServer:
    # vLLM's host:port form for the SSE one, a URL (trailing slash: normalized) for the other.
    spec = f"127.0.0.1:{sse_server.port}, {http_server.url}/"
    return asyncio.run(MCPToolServer.connect(spec))


@pytest.fixture(params=["calc", "calc_http"])
def server(request, tools):
    return tools.servers[request.param]


def test_connect_labels_servers_by_their_names(tools, sse_server, http_server):
    calc, calc_http = tools.servers["calc"], tools.servers["calc_http"]
    assert list(tools.servers) == ["calc", "calc_http"]
    assert (calc.url, calc.transport) == (sse_server.url, "sse")
    assert (calc_http.url, calc_http.transport) == (http_server.url, "streamable_http")
    assert calc.instructions == calc_http.instructions == INSTRUCTIONS


def test_list_tools(tools, server):
    listed = {t.name: t for t in asyncio.run(tools.list_tools(server))}
    assert set(listed) == {"add", "echo", "fail", "protocol_error", "sleep", "whoami"}
    add = listed["add"]
    assert add.description == "Add two integers."
    assert add.input_schema["type"] == "object"
    assert add.input_schema["required"] == ["a", "b"]
    assert add.input_schema["properties"]["a"]["type"] == "integer"
    assert add.annotations == {"readOnlyHint": True}
    assert listed["echo"].annotations is None


def test_calls(tools, server):
    async def calls():
        return await asyncio.gather(
            tools.call(server, "add", {"a": 2, "b": 3}),
            tools.call(server, "echo", {"text": "a\nb"}),
            tools.call(server, "fail", {"message": "boom"}),
            # The SDK's server answers an unknown tool with an isError result, not with a
            # JSON-RPC error: so it is a tool execution error.
            tools.call(server, "nope", {}),
            tools.call(server, "protocol_error", {"code": -32602, "message": "bad args"}),
        )

    add, echo, fail, unknown, protocol = asyncio.run(calls())
    assert (add.output, add.error) == ("5", None)
    assert (echo.output, echo.error) == ("a\nb", None)
    assert fail.error["type"] == "mcp_tool_execution_error"
    assert fail.error["content"][0]["type"] == "text"
    assert "boom" in fail.error["content"][0]["text"]
    assert unknown.error["type"] == "mcp_tool_execution_error"
    assert "Unknown tool" in unknown.error["content"][0]["text"]
    assert protocol.output is None
    assert protocol.error == {"type": "mcp_protocol_error", "code": -32602, "message": "bad args"}


def test_headers_reach_the_server(tools, server):
    result = asyncio.run(tools.call(server, "whoami", {}, headers={"Authorization": "Bearer t0k"}))
    assert (result.output, result.error) == ("Bearer t0k", None)


def test_a_call_past_its_timeout_is_a_504_at_once(tools, server):
    start = time.monotonic()
    result = asyncio.run(tools.call(server, "sleep", {"seconds": 30}, timeout_s=1.0))
    assert time.monotonic() - start < 5
    assert result.output is None
    assert result.error["type"] == "http_error"
    assert result.error["code"] == 504


def test_cancellation_propagates_and_leaves_nothing_running(tools, server):
    async def cancelled():
        before = asyncio.all_tasks()
        task = asyncio.create_task(tools.call(server, "sleep", {"seconds": 30}))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # let finished tasks be collected
        assert asyncio.all_tasks() - before == set()

    asyncio.run(asyncio.wait_for(cancelled(), 10))


def test_an_unreachable_server_is_a_502(tools, server):
    path = "/sse" if server.transport == "sse" else "/mcp"
    gone = dataclasses.replace(server, url=f"http://127.0.0.1:{get_open_port()}{path}")
    result = asyncio.run(tools.call(gone, "add", {"a": 1, "b": 2}, timeout_s=10))
    assert result.output is None
    assert result.error["type"] == "http_error"
    assert result.error["code"] == 502
    with pytest.raises(RuntimeError, match="cannot reach"):
        asyncio.run(tools.list_tools(gone, timeout_s=10))


def test_a_server_that_went_away(sse_server):
    with start_mcp_test_server("streamable-http", name="brief") as brief:
        tools = asyncio.run(MCPToolServer.connect(brief.url))
    result = asyncio.run(tools.call(tools.servers["brief"], "add", {"a": 1, "b": 2}))
    assert (result.error["type"], result.error["code"]) == ("http_error", 502)


def test_find(tools, sse_server, http_server):
    calc, calc_http = tools.servers["calc"], tools.servers["calc_http"]
    assert tools.find("calc") is calc
    assert tools.find("calc_http") is calc_http
    # By URL (normalized): the request's label is then only a label.
    assert tools.find("anything", http_server.url + "/") is calc_http
    assert tools.find("calc", sse_server.url.replace("http://", "HTTP://") + "/") is calc
    with pytest.raises(ValueError, match="no MCP server 'other'") as e:
        tools.find("other")
    assert "--tool-server" in str(e.value)
    assert sse_server.url in str(e.value) and "'calc_http'" in str(e.value)
    with pytest.raises(ValueError, match="no MCP server at server_url"):
        tools.find("calc", "http://evil.example/mcp")
    with pytest.raises(ValueError, match="no MCP server"):
        tools.find("calc", "not a url")


@pytest.mark.parametrize(
    "spec, words",
    [
        ("demo", "demo tools are not built"),
        ("nonsense::", "not host:port"),
        ("", "empty entry"),
        ("127.0.0.1:1,,", "empty entry"),
        ("localhost", "no port"),
        ("ftp://host/mcp", "not host:port or an http"),
        ("127.0.0.1:99999", "not host:port"),
    ],
)
def test_connect_refuses_malformed_specs(spec, words):
    with pytest.raises(ValueError, match=words):
        asyncio.run(MCPToolServer.connect(spec))


def test_connect_names_an_unreachable_url():
    url = f"http://127.0.0.1:{get_open_port()}/mcp"
    with pytest.raises(RuntimeError, match=f"cannot reach the MCP server at {url}"):
        asyncio.run(MCPToolServer.connect(url, timeout_s=10))


def test_connect_refuses_two_servers_with_one_label(sse_server):
    with start_mcp_test_server("streamable-http", name="calc") as twin:
        with pytest.raises(ValueError, match="two MCP servers call themselves 'calc'"):
            asyncio.run(MCPToolServer.connect(f"{sse_server.url},{twin.url}"))


def test_the_server_start_connects_or_fails_with_one_line(sse_server):
    from types import SimpleNamespace

    from vllm.entrypoints.openai.api_server import ToolServerStartupError, connect_tool_server
    from vllm.v1.engine.core_client import EngineStartupError

    assert asyncio.run(connect_tool_server(SimpleNamespace(tool_server=None))) is None
    args = SimpleNamespace(tool_server=f"127.0.0.1:{sse_server.port}")
    assert list(asyncio.run(connect_tool_server(args)).servers) == ["calc"]
    # vllm serve prints an EngineStartupError as "vllm serve: error: ..." and exits 1.
    assert issubclass(ToolServerStartupError, EngineStartupError)
    with pytest.raises(ToolServerStartupError, match="demo"):
        asyncio.run(connect_tool_server(SimpleNamespace(tool_server="demo")))
