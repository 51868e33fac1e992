"""If the engine process dies, the API server exits with status 1 (so a supervisor restarts
it); with --keep-alive-on-engine-death it stays, /health 503, requests fail fast with 500."""

from __future__ import annotations

import time

import psutil
import pytest
import requests

from ...utils import RemoteServer

pytestmark = pytest.mark.slow


def _kill_engine(server: RemoteServer) -> None:
    engine = [
        p
        for p in psutil.Process(server.proc.pid).children(recursive=True)
        if "--multiprocessing-fork" in p.cmdline()
    ]
    assert len(engine) == 1
    engine[0].kill()


def test_engine_death_exits_the_api_server(tmp_path):
    log = tmp_path / "server.log"
    server = RemoteServer("--num-gpu-blocks-override", "64", log_path=str(log))
    try:
        _kill_engine(server)
        assert server.proc.wait(10) == 1
    finally:
        server.stop()
    text = log.read_text()
    assert "The engine core died" in text and "the API server exits" in text
    assert "Traceback" not in text


def test_engine_death_is_reported_not_hung_when_kept_alive():
    server = RemoteServer("--num-gpu-blocks-override", "64", "--keep-alive-on-engine-death")
    try:
        _kill_engine(server)
        deadline = time.monotonic() + 10
        while requests.get(server.base + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after the engine died"
            time.sleep(0.2)
        start = time.monotonic()
        r = requests.post(
            server.base + "/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert r.status_code == 500 and "dead" in r.json()["error"]["message"]
        assert time.monotonic() - start < 5
        time.sleep(2)  # past the watchdog's check: still serving
        assert server.proc.poll() is None
    finally:
        server.stop()
    assert server.proc.returncode is not None  # SIGTERM shut the server down
