"""The MCP client behind the Responses API's ``mcp`` tools (``--tool-server``).

The server reaches only the MCP servers named at start-up (no SSRF through a request's
``server_url``): ``MCPToolServer.connect`` initializes each once, ``find`` maps a
request's tool onto one of them, ``list_tools`` / ``call`` each open a fresh session with
the request's headers (simple, and no state shared between requests or users).

The ``mcp`` package (the official SDK, 2.x) is imported only inside functions: a server
without --tool-server starts without it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from mcp.client.session import ClientSession

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# JSON-RPC's "internal error": a result the SDK could not accept (e.g. not matching the
# tool's output schema) is reported as a protocol error with this code.
_INTERNAL_ERROR = -32603


@dataclass(frozen=True)
class MCPTool:
    name: str
    description: str | None
    input_schema: dict[str, Any]  # JSON schema of the arguments
    annotations: dict[str, Any] | None  # MCP tool annotations (readOnlyHint etc.), or None


@dataclass(frozen=True)
class MCPServer:
    label: str  # the server's own name (initialize's serverInfo.name), as vLLM labels it
    url: str  # the URL it is reached at (normalized)
    transport: str  # "sse" or "streamable_http"
    instructions: str | None


@dataclass(frozen=True)
class MCPCallResult:
    """One call's outcome. ``output``: the tool's text content joined with "\\n" (kept
    on an isError result too), else its structured content as JSON text, else None.
    ``error``: None on success, else one of OpenAI's McpToolCallError shapes."""

    output: str | None
    error: dict[str, Any] | None


class _CallFailed(Exception):
    """A list/call that failed below the tool: ``error`` is the McpToolCallError shape."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message") or error["type"])
        self.error = error


class MCPToolServer:
    """The MCP servers given to --tool-server, by label."""

    def __init__(self, servers: dict[str, MCPServer]) -> None:
        self.servers = servers

    @classmethod
    async def connect(cls, spec: str, timeout_s: float = 30.0) -> MCPToolServer:
        """--tool-server's value: comma-separated entries, each ``host:port`` (vLLM's
        form: SSE at http://host:port/sse; IPv6 as [::1]:8000) or a full http(s) URL (a
        path ending in /sse: SSE; anything else: streamable HTTP). Each is initialized
        once, so a bad entry fails the start. ValueError for ``demo``, an empty or
        malformed entry, or two servers with one label; RuntimeError naming the URL of a
        server that could not be reached or initialized."""
        urls = [_parse_entry(entry) for entry in spec.split(",")]
        servers: dict[str, MCPServer] = {}
        for url in dict.fromkeys(urls):  # the same URL twice: once
            transport = _transport_of(url)
            probe = MCPServer(label=url, url=url, transport=transport, instructions=None)
            try:
                info = await _with_session(probe, None, timeout_s, _server_info)
            except _CallFailed as e:
                raise RuntimeError(
                    f"--tool-server: cannot reach the MCP server at {url} ({transport}): "
                    f"{e.error.get('message') or e.error['type']}"
                ) from None
            label, instructions = info
            if label in servers:
                raise ValueError(
                    f"--tool-server: two MCP servers call themselves {label!r} "
                    f"({servers[label].url} and {url}); labels must be unique"
                )
            servers[label] = MCPServer(label, url, transport, instructions)
            logger.info("MCP tool server %r at %s (%s)", label, url, transport)
        return cls(servers)

    def find(self, server_label: str, server_url: str | None = None) -> MCPServer:
        """The configured server a request's mcp tool names: by ``server_url`` when given
        (equal to a configured URL once normalized; the request's label is then only its
        label), else by ``server_label``. ValueError naming the servers there are."""
        if server_url:
            try:
                url = _normalize_url(server_url)
            except ValueError:
                url = None
            for server in self.servers.values():
                if server.url == url:
                    return server
            asked = f"at server_url {server_url!r}"
        else:
            if server_label in self.servers:
                return self.servers[server_label]
            asked = repr(server_label)
        known = ", ".join(f"{s.label!r} ({s.url})" for s in self.servers.values()) or "none"
        raise ValueError(
            f"no MCP server {asked}: this server reaches only the MCP servers given to "
            f"--tool-server: {known}."
        )

    async def list_tools(
        self,
        server: MCPServer,
        headers: dict[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> list[MCPTool]:
        """The server's tools now (a fresh session, with the request's headers).
        RuntimeError, naming the server, if they cannot be listed; only cancellation
        propagates otherwise."""
        try:
            return await _with_session(server, headers, timeout_s, _list_tools)
        except _CallFailed as e:
            message = e.error.get("message") or e.error["type"]
            raise RuntimeError(
                f"Cannot list the tools of MCP server {server.label!r} ({server.url}): {message}"
            ) from None

    async def call(
        self,
        server: MCPServer,
        name: str,
        arguments: dict[str, Any],
        headers: dict[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> MCPCallResult:
        """Run one tool call in a fresh session. Never raises for a tool, protocol or HTTP
        failure (those are ``MCPCallResult.error``); only cancellation propagates."""

        async def run(session: ClientSession) -> MCPCallResult:
            return _call_result(await session.call_tool(name, arguments))

        try:
            return await _with_session(server, headers, timeout_s, run)
        except _CallFailed as e:
            return MCPCallResult(output=None, error=e.error)


def _parse_entry(entry: str) -> str:
    """One --tool-server entry as a normalized URL; ValueError if it is not one."""
    entry = entry.strip()
    if not entry:
        raise ValueError("--tool-server: an empty entry (expected host:port or an http(s) URL)")
    if entry == "demo":
        raise ValueError(
            "--tool-server demo: vLLM's built-in demo tools are not built here; give "
            "host:port or http(s) URLs of MCP servers"
        )
    url = entry if "://" in entry else f"http://{entry}/sse"  # vLLM's host:port form
    try:
        normalized = _normalize_url(url)
    except ValueError as e:
        raise ValueError(
            f"--tool-server: {entry!r} is not host:port or an http(s) URL ({e})"
        ) from None
    if "://" not in entry and urlsplit(normalized).port is None:
        raise ValueError(f"--tool-server: {entry!r} has no port (host:port)")
    return normalized


def _normalize_url(url: str) -> str:
    """Scheme and host lowercased, no trailing slash, no fragment: how URLs compare.
    ValueError if it is not an http(s) URL with a host and a valid port."""
    parts = urlsplit(url.strip())
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"not an http(s) URL: {url!r}")
    if not parts.hostname:
        raise ValueError(f"no host in {url!r}")
    port = parts.port  # ValueError for a port that is not a number in range
    host = parts.hostname  # lowercased, without brackets
    netloc = f"[{host}]" if ":" in host else host
    if port is not None:
        netloc = f"{netloc}:{port}"
    if parts.username or parts.password:
        raise ValueError(f"credentials in {url!r}: give them as headers instead")
    return urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), parts.query, ""))


def _transport_of(url: str) -> str:
    return "sse" if urlsplit(url).path.endswith("/sse") else "streamable_http"


@asynccontextmanager
async def _open_session(
    server: MCPServer, headers: dict[str, str] | None, timeout_s: float
) -> AsyncIterator[ClientSession]:
    """An initialized session over the server's transport, with ``headers`` on every
    HTTP request."""
    import httpx2
    from mcp.client.session import ClientSession

    # Reads wait as long as the whole operation may; the outer fail_after is the limit.
    http_timeout = httpx2.Timeout(min(timeout_s, 30.0), read=timeout_s)
    if server.transport == "sse":
        from mcp.client.sse import sse_client

        transport = sse_client(
            server.url, headers=headers, timeout=min(timeout_s, 30.0), sse_read_timeout=timeout_s
        )
        async with transport as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session
    else:
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        client = create_mcp_http_client(headers=headers, timeout=http_timeout)
        async with (
            client,
            streamable_http_client(server.url, http_client=client) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session


async def _with_session(
    server: MCPServer,
    headers: dict[str, str] | None,
    timeout_s: float,
    op: Callable[[ClientSession], Awaitable[_T]],
) -> _T:
    """``op`` over a fresh session, all of it within ``timeout_s``. Any failure but
    cancellation is raised as ``_CallFailed`` (never an ExceptionGroup from the
    transport's task group); the transport is closed, and its tasks ended, either way."""
    import anyio

    try:
        with anyio.fail_after(timeout_s):
            async with _open_session(server, headers, timeout_s) as session:
                return await op(session)
    except _CallFailed:
        raise
    except Exception as e:  # ExceptionGroup included; CancelledError is not an Exception
        raise _CallFailed(_error_of(e, server, timeout_s)) from e


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _error_of(exc: BaseException, server: MCPServer, timeout_s: float) -> dict[str, Any]:
    """The McpToolCallError shape for a failure of a list/call below the tool."""
    import httpx2
    from mcp.shared.exceptions import MCPError

    leaves = _leaves(exc)
    # A group's other leaves are mostly the cancellations its first failure caused.
    real = [e for e in leaves if isinstance(e, Exception)] or leaves
    for leaf in real:
        if isinstance(leaf, _CallFailed):  # raised by an op, then grouped on the way out
            return leaf.error
    for leaf in real:
        if isinstance(leaf, TimeoutError | httpx2.TimeoutException):
            return _http_error(504, f"MCP server {server.url} did not answer in {timeout_s:g} s")
    for leaf in real:
        if isinstance(leaf, httpx2.HTTPStatusError):
            status = leaf.response.status_code
            return _http_error(status, f"MCP server {server.url} answered HTTP {status}")
        if isinstance(leaf, httpx2.TransportError | OSError):
            return _http_error(502, f"cannot reach MCP server {server.url}: {leaf or type(leaf)}")
    for leaf in real:
        if isinstance(leaf, MCPError):
            return {"type": "mcp_protocol_error", "code": leaf.code, "message": leaf.message}
    leaf = real[0]
    logger.warning("MCP request to %s failed", server.url, exc_info=leaf)
    message = f"{type(leaf).__name__}: {leaf}"
    return {"type": "mcp_protocol_error", "code": _INTERNAL_ERROR, "message": message}


def _http_error(code: int, message: str) -> dict[str, Any]:
    return {"type": "http_error", "code": code, "message": message}


async def _server_info(session: ClientSession) -> tuple[str, str | None]:
    """(serverInfo.name, instructions) of an initialized session."""
    info = session.server_info
    name = info.name if info is not None else None
    if not name:
        raise _CallFailed(
            {"type": "mcp_protocol_error", "code": _INTERNAL_ERROR, "message": "no server name"}
        )
    return name, session.instructions


async def _list_tools(session: ClientSession) -> list[MCPTool]:
    from mcp_types import PaginatedRequestParams

    tools: list[MCPTool] = []
    cursor: str | None = None
    while True:
        params = PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await session.list_tools(params=params)
        for tool in page.tools:
            annotations = tool.annotations
            tools.append(
                MCPTool(
                    name=tool.name,
                    description=tool.description,
                    input_schema=dict(tool.input_schema),
                    annotations=(
                        annotations.model_dump(mode="json", by_alias=True, exclude_none=True)
                        if annotations is not None
                        else None
                    ),
                )
            )
        cursor = page.next_cursor
        if not cursor:
            return tools


def _call_result(result: Any) -> MCPCallResult:
    """A CallToolResult as an MCPCallResult."""
    texts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if texts:
        output: str | None = "\n".join(texts)
    elif result.structured_content is not None:
        output = json.dumps(result.structured_content)
    else:
        output = None
    if not result.is_error:
        return MCPCallResult(output=output, error=None)
    content = [
        block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content
    ]
    return MCPCallResult(
        output=output, error={"type": "mcp_tool_execution_error", "content": content}
    )
