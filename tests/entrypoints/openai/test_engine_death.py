"""If the engine process dies, /health turns 503 and requests fail fast with a 500."""

from __future__ import annotations

import time

import psutil
import pytest
import requests

from ...utils import RemoteServer

pytestmark = pytest.mark.slow


def test_engine_death_is_reported_not_hung():
    server = RemoteServer("--num-gpu-blocks-override", "64")
    try:
        engine = [
            p
            for p in psutil.Process(server.proc.pid).children(recursive=True)
            if "--multiprocessing-fork" in p.cmdline()
        ]
        assert len(engine) == 1
        engine[0].kill()
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
    finally:
        server.stop()
    assert server.proc.returncode is not None  # SIGTERM shut the server down
