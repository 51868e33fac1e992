"""The real Claude Code CLI against the server (``slow``; skipped unless the ``claude``
binary is on PATH or named by ``CLAUDE_CODE_BIN``: it is not a Python package, so the
test environment does not install it). To run it::

    npm install --prefix /tmp/cc @anthropic-ai/claude-code
    CLAUDE_CODE_BIN=/tmp/cc/node_modules/.bin/claude make test ARGS="-k claude_code_cli"

One headless turn (``claude -p --bare``, one tool, a system prompt of ours): the turn
completes, and the server names its job by the session Claude Code reports.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from ..openai.test_tool_calling_e2e import MODEL, agent_server

CLAUDE = os.environ.get("CLAUDE_CODE_BIN") or shutil.which("claude")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CLAUDE is None, reason="the Claude Code CLI is not installed"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = agent_server(tmp_path_factory.mktemp("claude_code"))
    yield srv
    srv.stop()


def test_one_claude_code_turn_is_served_as_a_job(server, tmp_path):
    env = {
        **os.environ,
        "ANTHROPIC_BASE_URL": server.base,
        "ANTHROPIC_API_KEY": "EMPTY",
        "ANTHROPIC_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "HOME": str(tmp_path),  # no settings, history or credentials of the user's
        "IS_SANDBOX": "1",
    }
    cmd = [
        CLAUDE, "-p", "What is the capital of France?", "--bare", "--tools", "Bash",
        "--system-prompt", "You answer in one short sentence.", "--max-turns", "1",
        "--output-format", "json",
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not result["is_error"], result
    assert result["usage"]["output_tokens"] > 0
    log = (server.out_dir / "server.log").read_text()
    assert f"job_id='{result['session_id']}/" in log
