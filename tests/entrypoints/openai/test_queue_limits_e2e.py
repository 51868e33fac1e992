"""End-to-end: vLLM's queue limits, --max-num-queued-reqs and --max-num-queued-tokens.

The engine is put to sleep (``VLLM_SERVER_DEV_MODE=1``, --enable-sleep-mode) so that
admitted requests stay queued, producing nothing, for as long as the test needs: the
counts are then exact. A refused request is a 503 in vLLM's error shape, counted in
``vllm:admission_rejections{reason=...}``, and leaves nothing behind: once the engine
wakes, the admitted requests finish, the queue and KV cache are empty, and new requests
are served.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.entrypoints.test_generation_config import tiny_model
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow
MAX_REQS = 3
MAX_TOKENS = 40  # prompt tokens of requests with no output yet
SHORT = [11, 12, 13, 14]  # a prompt of 4 token ids


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    args = (
        "--model", model, "--enable-sleep-mode", "--max-model-len", "256",
        "--max-num-queued-reqs", str(MAX_REQS), "--max-num-queued-tokens", str(MAX_TOKENS),
    )  # fmt: skip
    log = tmp_path_factory.mktemp("queue") / "server.log"
    with RemoteServer(*args, log_path=str(log), env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
        yield srv


def body(model: str, prompt: list[int], **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 8, "ignore_eos": True, **extra}


def open_stream(server: RemoteServer, payload: dict) -> requests.Response:
    """A streamed completion: its headers come back once the server admitted it."""
    return requests.post(
        server.base + "/v1/completions", json={**payload, "stream": True}, stream=True, timeout=60
    )


def finish(r: requests.Response) -> str | None:
    reason = None
    with r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
    return reason


def metrics(server: RemoteServer) -> dict[str, float]:
    values = {}
    for line in requests.get(server.base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(("vllm:admission_rejections_total{", "vllm:num_requests_")):
            name, value = line.rsplit(" ", 1)
            reason = name.split('reason="')[1].split('"')[0] if "reason=" in name else None
            values[reason or name.split("{")[0]] = float(value)
        elif line.startswith("vllm:kv_cache_usage_perc{"):
            values["kv"] = float(line.rsplit(" ", 1)[1])
    return values


def wait_until_empty(server: RemoteServer) -> None:
    """Until the server holds no request (``/get_load``: its requests in flight)."""
    deadline = time.monotonic() + 30
    while requests.get(server.base + "/get_load", timeout=30).json()["load"]:
        assert time.monotonic() < deadline, "the aborted request is still held"
        time.sleep(0.05)


def assert_refused(r: requests.Response) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["type"] == "Service Unavailable" and error["code"] == 503
    assert "try again later" in error["message"]


def test_queue_limits_refuse_with_503_count_the_reason_and_leave_nothing(server, model):
    base = server.base
    start = metrics(server)
    assert start["max_num_queued_reqs"] == start["max_num_queued_tokens"] == 0
    assert requests.post(base + "/sleep", params={"level": 1}, timeout=60).status_code == 200

    # Token limit: a 40-token prompt with no output yet holds the backlog at the limit.
    long = open_stream(server, body(model, list(range(10, 10 + MAX_TOKENS))))
    assert long.status_code == 200
    r = requests.post(base + "/v1/completions", json=body(model, SHORT), timeout=60)
    assert_refused(r)
    assert metrics(server)["max_num_queued_tokens"] == 1
    long.close()  # the client leaves: the server aborts it, and its prompt stops counting
    wait_until_empty(server)

    # Request limit: of 7 concurrent requests, 3 are admitted (they wait: the engine
    # sleeps) and the others refused, however the race goes; the refused leave no trace.
    def attempt(i: int) -> requests.Response:
        return open_stream(server, body(model, SHORT, max_tokens=4 + i))

    with ThreadPoolExecutor(7) as pool:
        responses = list(pool.map(attempt, range(7)))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(admitted) == MAX_REQS, [r.status_code for r in responses]
    for r in refused:
        assert_refused(r)
    # The chat endpoint and n > 1 are refused alike.
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_refused(requests.post(base + "/v1/chat/completions", json=chat, timeout=60))
    seen = metrics(server)
    assert seen["max_num_queued_reqs"] == len(refused) + 1
    assert seen["max_num_queued_tokens"] == 1

    # Awake: the admitted ones run to their end; nothing else was queued.
    reasons: list[str | None] = []
    readers = [threading.Thread(target=lambda r=r: reasons.append(finish(r))) for r in admitted]
    for t in readers:
        t.start()
    assert requests.post(base + "/wake_up", timeout=60).status_code == 200
    for t in readers:
        t.join(60)
    assert reasons == ["length"] * MAX_REQS
    out = requests.post(base + "/v1/completions", json=body(model, SHORT, n=MAX_REQS), timeout=60)
    assert out.status_code == 200 and len(out.json()["choices"]) == MAX_REQS
    end = metrics(server)
    assert end["vllm:num_requests_running"] == end["vllm:num_requests_waiting"] == 0
    assert end["kv"] == 0
    assert end["max_num_queued_reqs"] == seen["max_num_queued_reqs"]
    wait_until_empty(server)
