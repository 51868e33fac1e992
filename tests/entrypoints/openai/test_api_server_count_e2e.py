"""End-to-end: `vllm serve --api-server-count 2`, two API servers in front of one engine.

Both serve (on the one port), the metrics any of them answers count every server's
requests once, a Responses chain continues whichever server each turn lands on, and the
process tree lives and dies as one: SIGTERM drains and exits 0; an API server's death
stops the rest with status 1; a killed `vllm serve` leaves no process behind.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests

from vllm.entrypoints.utils import get_open_port

from ...utils import RemoteServer

pytestmark = pytest.mark.slow

ARGS = ("--api-server-count", "2", "--max-model-len", "1024", "--num-gpu-blocks-override", "256")


def _children(server: RemoteServer) -> list[psutil.Process]:
    """The engine core and the API servers (multiprocessing's resource tracker aside)."""
    procs = psutil.Process(server.proc.pid).children()
    return [p for p in procs if "spawn_main" in " ".join(p.cmdline())]


def _engine_pid(log_text: str) -> int:
    return int(re.search(r"Engine core ready: .*\(pid (\d+)\)", log_text).group(1))


def _gone(procs: list[psutil.Process], timeout_s: float) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return not alive


def _complete(server: RemoteServer, max_tokens: int) -> dict:
    body = {"prompt": "The capital of France is", "max_tokens": max_tokens, "ignore_eos": True}
    # requests.post: a new connection each, so the kernel picks an API server each time
    r = requests.post(server.base + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_two_api_servers_share_one_engine_its_metrics_and_stored_responses(tmp_path):
    log = tmp_path / "server.log"
    server = RemoteServer(*ARGS, log_path=str(log))
    try:
        children = _children(server)
        assert len(children) == 3  # the engine core and two API servers
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            done = list(pool.map(lambda i: _complete(server, 4 + i % 3), range(24)))
        tokens = sum(d["usage"]["completion_tokens"] for d in done)
        assert tokens == sum(4 + i % 3 for i in range(24))
        text = log.read_text()
        served = {i: text.count(f"[api {i}] vllm.entrypoints.openai.api_server: completion")
                  for i in (0, 1)}  # fmt: skip
        assert served[0] + served[1] == 24 and served[0] > 0 and served[1] > 0, served

        # Whichever server answers /metrics, it counts both servers' requests once. A
        # response goes out before its step's stats are recorded (they wait for the woken
        # handlers), so the last step's may land just after the last answer.
        server.wait_metric("vllm:num_requests_running", 0.0)
        server.wait_metric("vllm:e2e_request_latency_seconds_count", 24.0)
        for _ in range(4):
            m = server.metrics()
            assert m["vllm:e2e_request_latency_seconds_count"] == 24
            assert m["vllm:generation_tokens_total"] == tokens
            assert m["vllm:num_requests_running"] == 0 and m["vllm:engine_alive"] == 1
            prompt = sum(d["usage"]["prompt_tokens"] for d in done)
            assert m["vllm:prompt_tokens_total"] == prompt
            # The engine's per-step series come from API server 0 alone: each step's
            # scheduled tokens once (the prompts, then every token but each first).
            scheduled = prompt - m["vllm:prompt_tokens_cached_total"] + tokens - 24
            assert m["vllm:iteration_tokens_total_sum"] == scheduled
        assert requests.get(server.base + "/get_load", timeout=5).json() == {"load": 0}
        # While two requests run, either server's /get_load counts both (the engine's).
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            running = [pool.submit(_complete, server, 120) for _ in range(2)]
            deadline = time.monotonic() + 30
            while server.metrics()["vllm:num_requests_running"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            loads = [requests.get(server.base + "/get_load", timeout=5).json() for _ in range(8)]
            assert loads == [{"load": 2}] * 8
            for f in running:
                f.result()

        # A Responses chain: each turn on a new connection, any server.
        previous = None
        ids = []
        for turn in range(6):
            body = {"input": f"Turn {turn}: say something.", "max_output_tokens": 4}
            if previous is not None:
                body["previous_response_id"] = previous
            r = requests.post(server.base + "/v1/responses", json=body, timeout=120)
            assert r.status_code == 200, r.text
            previous = r.json()["id"]
            ids.append(previous)
        for response_id in ids:
            r = requests.get(f"{server.base}/v1/responses/{response_id}", timeout=10)
            assert r.status_code == 200 and r.json()["id"] == response_id

        # A streamed chat completion through the openai client.
        client = server.client()
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=5,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [c for c in stream if c.choices and c.choices[0].delta.content]
        assert 1 <= len(chunks) <= 5

        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)  # the parent alone, as `kill PID` does
        assert server.proc.wait(30) == 0
        assert time.monotonic() - start < 15
        assert _gone(children, 10)
    finally:
        server.stop()
    text = log.read_text()
    assert "Traceback" not in text
    assert "[api 0] vllm.entrypoints.launcher: SIGTERM received: draining" in text
    assert "[api 1] vllm.entrypoints.launcher: SIGTERM received: draining" in text


def test_an_api_server_that_dies_stops_the_whole_server(tmp_path):
    log = tmp_path / "server.log"
    server = RemoteServer(*ARGS, log_path=str(log))
    try:
        children = _children(server)
        engine_pid = _engine_pid(log.read_text())
        api_servers = [p for p in children if p.pid != engine_pid]
        assert len(api_servers) == 2
        _complete(server, 2)
        api_servers[0].kill()
        assert server.proc.wait(40) == 1
        assert _gone(children, 10)
    finally:
        server.stop()
    assert "exited (exit code -9): stopping" in log.read_text()


def test_a_killed_vllm_serve_leaves_no_process(tmp_path):
    log = tmp_path / "server.log"
    server = RemoteServer(*ARGS, log_path=str(log))
    try:
        children = _children(server)
        assert len(children) == 3
        server.proc.kill()  # SIGKILL to the parent alone: no cleanup of its own
        server.proc.wait(10)
        assert _gone(children, 20)  # death pipes: the engine, then the API servers
    finally:
        server.stop()
        for p in children:
            if p.is_running():
                p.kill()
    text = log.read_text()
    assert "front end closed its death pipe" in text


def test_an_engine_that_fails_to_start_is_one_error_line_and_status_1():
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "-asc", "2",
           "--port", str(get_open_port()), "--kv-cache-memory", "1KiB"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if line.startswith("vllm serve: error:")]
    assert len(lines) == 1 and "kv_cache_memory too small" in lines[0], out.stderr


def test_kept_alive_api_servers_answer_503_after_the_engine_dies(tmp_path):
    log = tmp_path / "server.log"
    server = RemoteServer(*ARGS, "--keep-alive-on-engine-death", log_path=str(log))
    try:
        children = _children(server)
        engine = psutil.Process(_engine_pid(log.read_text()))
        engine.kill()
        engine.wait(10)
        time.sleep(2)  # the API servers notice (keepalive pipe), the parent logs it
        for _ in range(4):  # whichever server answers
            assert requests.get(server.base + "/health", timeout=5).status_code == 503
            r = requests.post(server.base + "/v1/completions", json={"prompt": "hi"}, timeout=5)
            assert r.status_code in (500, 503), r.text
        assert server.proc.poll() is None  # the parent neither exits nor spins
        parent = psutil.Process(server.proc.pid)
        busy = parent.cpu_times()
        time.sleep(2)
        spent = sum(parent.cpu_times()[:2]) - sum(busy[:2])
        assert spent < 0.5
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert _gone(children, 10)
    finally:
        server.stop()
    assert "The engine core exited" in log.read_text()
