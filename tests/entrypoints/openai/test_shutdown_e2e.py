"""End-to-end: SIGTERM drains the server (issue 16).

New requests are refused (503) and /health is 503 at once; a stream that ends within
--shutdown-timeout completes normally; one still running then ends with an OpenAI-shaped
error event and [DONE]; the server exits 0 with no traceback in its log.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import psutil
import pytest
import requests

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
SHUTDOWN_TIMEOUT_S = 8


def _stream(server, max_tokens: int, out: dict) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True}
    body["stream"] = True
    events = out["events"] = []
    with requests.post(server.base + "/v1/completions", json=body, stream=True, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                events.append(line[6:].decode())


def test_sigterm_drains_then_ends_streams_with_an_error_event(tmp_path):
    log = tmp_path / "server.log"
    server = RemoteServer(
        "--num-gpu-blocks-override",
        "128",
        "--max-model-len",
        "1024",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        log_path=str(log),
    )
    short, long = {}, {}
    try:
        threads = [
            threading.Thread(target=_stream, args=(server, 4, short)),
            threading.Thread(target=_stream, args=(server, 1000, long)),
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not (short.get("events") and long.get("events")):  # both running
            assert time.monotonic() < deadline
            time.sleep(0.1)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)  # the API server alone, as `kill PID` does
        time.sleep(0.3)
        health = requests.get(server.base + "/health", timeout=5)
        assert health.status_code == 503 and "shutting down" in health.text
        r = requests.post(server.base + "/v1/completions", json={"prompt": "hi"}, timeout=5)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        for t in threads:
            t.join(60)
        assert server.proc.wait(30) == 0
        elapsed = time.monotonic() - start
    finally:
        server.stop()
    assert SHUTDOWN_TIMEOUT_S - 0.5 < elapsed < SHUTDOWN_TIMEOUT_S + 10
    # The short stream finished normally.
    assert short["events"][-1] == "[DONE]"
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in short["events"][:-1]]
    assert finals[-1] == "length"
    # The long one was cut by the drain's deadline: an error event, then [DONE].
    assert long["events"][-1] == "[DONE]"
    error = json.loads(long["events"][-2])["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    text = log.read_text()
    assert "Traceback" not in text and "Ending 1 request(s) still running" in text


@pytest.mark.parametrize("api_servers", [1, 2])
def test_sigterm_while_the_engine_loads_stops_the_server(tmp_path, api_servers):
    """A signal before the server serves stops it (uvloop used to log the start-up
    handler's exception and go on starting)."""
    log = tmp_path / "server.log"
    server = RemoteServer("--api-server-count", str(api_servers), log_path=str(log), wait=False)
    try:
        deadline = time.monotonic() + 60
        while "Starting the engine core" not in log.read_text():
            assert time.monotonic() < deadline and server.proc.poll() is None
            time.sleep(0.1)
        time.sleep(1.0)  # inside the event loop, the engine loading
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert len(children) >= api_servers  # engine and API servers (and a tracker)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive
    finally:
        server.stop()
    text = log.read_text()
    assert "Traceback" not in text and "Exception in callback" not in text
    # One API server: its start-up handler; several: the parent's, forwarded.
    assert "SIGTERM received" in text
    assert "Starting vLLM API server" not in text
