"""If the engine process dies, the API server exits with status 1 (so a supervisor restarts
it); with --keep-alive-on-engine-death it stays, /health 503, requests fail fast with 500,
and /metrics reports a dead engine (vllm:engine_alive 0, state gauges 0) instead of
freezing at the last step."""

from __future__ import annotations

import threading
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


def _long_request(server: RemoteServer) -> None:
    # Running when the engine dies: it ends with an error, whatever the status.
    try:
        requests.post(
            server.base + "/v1/completions",
            timeout=60,
            json={"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True},
        )
    except requests.RequestException:
        pass


def test_engine_death_is_reported_not_hung_when_kept_alive():
    server = RemoteServer("--num-gpu-blocks-override", "64", "--keep-alive-on-engine-death")
    try:
        running = threading.Thread(target=_long_request, args=(server,))
        running.start()
        assert server.wait_metric("vllm:num_requests_running", 1.0) == 1.0
        before = server.metrics()
        assert before["vllm:engine_alive"] == 1.0 and before["vllm:kv_cache_usage_perc"] > 0
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
        running.join(30)
        # The gauges do not freeze at the last step's values (one request running, KV in
        # use): nothing runs in a dead engine, and vllm:engine_alive says why.
        after = server.metrics()
        assert after["vllm:engine_alive"] == 0.0
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert after[f"vllm:{name}"] == 0.0, name
        assert after["vllm:generation_tokens_total"] >= before["vllm:generation_tokens_total"]
        time.sleep(2)  # past the watchdog's check: still serving
        assert server.proc.poll() is None
    finally:
        server.stop()
    assert server.proc.returncode is not None  # SIGTERM shut the server down
