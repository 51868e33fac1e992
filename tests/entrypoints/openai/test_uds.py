"""vLLM's --uds: serving on a Unix domain socket instead of host and port."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from vllm.benchmarks.server import popen_session
from vllm.entrypoints.cli.serve import bind_unix_socket


def test_a_stale_socket_file_is_replaced_and_a_live_one_or_a_file_refused(tmp_path):
    path = str(tmp_path / "s.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # what a killed server leaves: the file, no listener
    live = bind_unix_socket(path)
    live.listen()
    try:
        with pytest.raises(OSError, match="already listening"):
            bind_unix_socket(path)
    finally:
        live.close()
    other = tmp_path / "plain"
    other.write_text("x")
    with pytest.raises(OSError, match="not a socket"):
        bind_unix_socket(str(other))


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the standard library's client, its socket swapped)."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.path)


def _request(path: str, method: str, url: str, body: dict | None = None):
    conn = _UnixConnection(path)
    try:
        payload = None if body is None else json.dumps(body)
        conn.request(method, url, payload, {"content-type": "application/json"})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


@pytest.mark.slow
def test_serve_answers_over_the_socket_and_removes_it(tmp_path):
    from tests.entrypoints.test_generation_config import tiny_model

    model = tiny_model(tmp_path / "tiny")
    path = tmp_path / "api.sock"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "--model", model,
           "--uds", str(path), "--api-server-count", "2"]  # fmt: skip
    log = open(tmp_path / "server.log", "w")
    proc = popen_session(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-2000:]
            try:
                if _request(str(path), "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        body = {"model": model, "prompt": "Hi", "max_tokens": 3}
        status, headers, data = _request(str(path), "POST", "/v1/completions", body)
        assert status == 200, data
        assert headers["x-vllm-instance"] == f"unix:{path}"
        assert json.loads(data)["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)  # the server's own shutdown
        proc.wait(60)
        log.close()
    assert not path.exists()
