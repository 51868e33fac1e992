"""End-to-end: vLLM's sleep-mode development routes (``VLLM_SERVER_DEV_MODE=1`` and
--enable-sleep-mode), on a tiny random Llama.

``POST /sleep`` aborts the running requests (their streams end with finish_reason
abort); a request sent while asleep waits and is served after ``POST /wake_up``, with the
greedy text of before; ``GET /is_sleeping`` and the ``vllm:engine_sleep_state`` gauge
follow. Without --enable-sleep-mode ``/sleep`` is an OpenAI-style 400.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from tests.entrypoints.test_generation_config import tiny_model
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow
PROMPT = "The tide came in over the flats while the gulls argued"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(tmp_path_factory.mktemp("tiny"))


def complete(server: RemoteServer, model: str, max_tokens: int = 12) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    r = requests.post(server.base + "/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def sleep_state(server: RemoteServer) -> dict[str, float]:
    text = requests.get(server.base + "/metrics", timeout=30).text
    states = {}
    for line in text.splitlines():
        if line.startswith("vllm:engine_sleep_state{"):
            state = line.split('sleep_state="')[1].split('"')[0]
            states[state] = float(line.rsplit(" ", 1)[1])
    return states


def is_sleeping(server: RemoteServer) -> bool:
    return requests.get(server.base + "/is_sleeping", timeout=30).json()["is_sleeping"]


def stream_until_done(server: RemoteServer, model: str, started: threading.Event, out: dict):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    with requests.post(
        server.base + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                started.set()
                choice = json.loads(line[6:])["choices"][0]
                out["finish_reason"] = choice["finish_reason"] or out.get("finish_reason")


def test_sleep_and_wake_up_routes(model, tmp_path):
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    args = ("--model", model, "--enable-sleep-mode", "--max-model-len", "512")
    with RemoteServer(*args, log_path=str(tmp_path / "server.log"), env=env) as server:
        before = complete(server, model)
        assert not is_sleeping(server)
        assert sleep_state(server) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}

        # A stream running when the engine goes to sleep ends with finish_reason abort.
        started, stream = threading.Event(), {}
        reader = threading.Thread(target=stream_until_done, args=(server, model, started, stream))
        reader.start()
        assert started.wait(60)
        r = requests.post(server.base + "/sleep", params={"level": 1}, timeout=60)
        assert r.json() == {"status": "sleeping", "level": 1}
        reader.join(60)
        assert stream["finish_reason"] == "abort"
        assert is_sleeping(server)
        assert sleep_state(server) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}

        # A request sent while asleep waits (the server stays healthy), then is served.
        late: dict = {}
        waiter = threading.Thread(target=lambda: late.update(text=complete(server, model)))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and requests.get(server.base + "/health").status_code == 200
        r = requests.post(server.base + "/wake_up", timeout=60)
        assert r.json() == {"status": "awake", "tags": None}
        waiter.join(60)
        assert late["text"] == before
        assert sleep_state(server)["awake"] == 1

        # Level 2, woken one tag at a time: the weights come back from the checkpoint.
        requests.post(server.base + "/sleep", params={"level": 2}, timeout=60)
        assert sleep_state(server) == {"awake": 0, "weights_offloaded": 0, "discard_all": 1}
        r = requests.post(server.base + "/wake_up", params={"tags": "weights"}, timeout=60)
        assert r.json() == {"status": "sleeping", "tags": ["weights"]}
        assert is_sleeping(server)
        r = requests.post(server.base + "/wake_up", params={"tags": "kv_cache"}, timeout=60)
        assert r.json() == {"status": "awake", "tags": ["kv_cache"]}
        assert not is_sleeping(server)
        assert complete(server, model) == before

        bad = requests.post(server.base + "/wake_up", params={"tags": "bogus"}, timeout=60)
        assert bad.status_code == 400 and "tags" in bad.json()["error"]["message"]
        bad = requests.post(server.base + "/sleep", params={"level": 3}, timeout=60)
        assert bad.status_code == 400


def test_sleep_without_the_flag_is_a_400(model, tmp_path):
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    with RemoteServer("--model", model, log_path=str(tmp_path / "s.log"), env=env) as server:
        r = requests.post(server.base + "/sleep", params={"level": 1}, timeout=60)
        assert r.status_code == 400
        assert "--enable-sleep-mode" in r.json()["error"]["message"]
        assert not is_sleeping(server)
        assert complete(server, model, max_tokens=2)  # the engine still serves
