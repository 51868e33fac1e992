"""A small MCP server for the tests of the Responses API's ``mcp`` tools.

Run as ``python tests/entrypoints/openai/mcp_test_server.py --port N --transport
sse|streamable-http [--name calc]``: SSE at ``http://127.0.0.1:N/sse``, streamable HTTP
at ``http://127.0.0.1:N/mcp``. Built on the mcp SDK's ``MCPServer`` (mcp 2.x's FastMCP).

``start_mcp_test_server`` (a context manager) runs it as a subprocess for a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

# At module level: the tools' annotations (``ctx: Context``) are evaluated by name here.
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import ToolAnnotations

if TYPE_CHECKING:
    from tests.utils import RemoteServer

INSTRUCTIONS = "Test tools: add, echo, fail, protocol_error, sleep, whoami."


def build_server(name: str) -> MCPServer:
    """The test server: add (read-only), echo, fail (always an isError result),
    protocol_error (a JSON-RPC error), sleep, whoami (the Authorization header)."""
    server = MCPServer(name, instructions=INSTRUCTIONS, log_level="WARNING")

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def fail(message: str) -> str:
        """Always fails with the message (the call result has isError)."""
        raise ToolError(message)  # an expected failure: no traceback in the server's log

    @server.tool()
    def protocol_error(code: int, message: str) -> str:
        """Answers with a JSON-RPC error (not a result): an MCP protocol error. (The SDK
        reports an unknown tool as an isError result, not as one.)"""
        raise MCPError(code, message)

    @server.tool()
    async def sleep(seconds: float) -> str:
        """Sleep, then say how long."""
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool()
    def whoami(ctx: Context) -> str:
        """The request's Authorization header ("" if none)."""
        headers = ctx.headers or {}
        return headers.get("authorization", "")

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--transport", choices=("sse", "streamable-http"), required=True)
    parser.add_argument("--name", default="calc")
    args = parser.parse_args()
    server = build_server(args.name)
    server.run(args.transport, host=args.host, port=args.port)


@dataclass(frozen=True)
class RunningMCPServer:
    url: str  # the endpoint: .../sse or .../mcp
    port: int
    process: subprocess.Popen


@contextlib.contextmanager
def start_mcp_test_server(
    transport: str, name: str = "calc", timeout_s: float = 30.0
) -> Iterator[RunningMCPServer]:
    """Run the test server on a free port until the block ends; the process group is
    killed on exit, so nothing outlives the test."""
    from vllm.entrypoints.utils import get_open_port

    port = get_open_port()
    cmd = [sys.executable, __file__, "--port", str(port), "--transport", transport]
    process = subprocess.Popen([*cmd, "--name", name], start_new_session=True)
    path = "/sse" if transport == "sse" else "/mcp"
    try:
        _wait_listening(process, port, timeout_s)
        yield RunningMCPServer(f"http://127.0.0.1:{port}{path}", port, process)
    finally:
        stop_process_group(process)


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's group (it leads its own session) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def _wait_listening(process: subprocess.Popen, port: int, timeout_s: float) -> None:
    """Until the port accepts connections (uvicorn binds once the app is ready)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"MCP test server exited with {process.returncode}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"MCP test server not listening on port {port} after {timeout_s} s")


if __name__ == "__main__":
    main()


def serve_with_tool_server(url: str, log_dir) -> RemoteServer:
    """``vllm serve`` of the default model for MCP tests: Continuum, hermes tool calls
    (the tiny model's template), and ``url`` as its --tool-server; its log in
    ``log_dir``."""
    from tests.utils import RemoteServer

    from .test_tool_calling_e2e import TEMPLATE

    return RemoteServer(
        "--scheduling-policy", "continuum", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--chat-template", TEMPLATE,
        "--tool-server", url, log_path=str(log_dir / "server.log"),
    )  # fmt: skip
