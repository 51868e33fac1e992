"""Fixtures shared by the OpenAI and Anthropic routes' tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def mcp_server():
    """The test MCP server (``calc``: add, echo, fail, ...) over streamable HTTP."""
    from tests.entrypoints.openai.mcp_test_server import start_mcp_test_server

    with start_mcp_test_server("streamable-http", name="calc") as running:
        yield running


@pytest.fixture(scope="module")
def mcp_served(mcp_server, tmp_path_factory):
    """``vllm serve`` with ``mcp_server`` as its --tool-server (one per test module)."""
    from tests.entrypoints.openai.mcp_test_server import serve_with_tool_server

    srv = serve_with_tool_server(mcp_server.url, tmp_path_factory.mktemp("mcp_served"))
    yield srv
    srv.stop()
