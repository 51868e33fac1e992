"""End-to-end: guided decoding's limits and checks on the real server (slow)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
RUN_BASH = {
    "type": "function",
    "function": {
        "name": "run_bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}
LOOP = {"$ref": "#/$defs/a"}


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--num-gpu-blocks-override", "128", "--max-model-len", "512")
    try:
        yield srv
    finally:
        srv.stop()


def chat(server, timeout: float = 120, **fields) -> requests.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return requests.post(f"{server.base}/v1/chat/completions", json=body, timeout=timeout)


def test_100k_choices_are_a_quick_400_and_block_nothing(server):
    chat(server, max_tokens=2, structured_outputs={"choice": ["yes", "no"]})  # warm up
    health: list[float] = []

    def poll():
        for _ in range(10):
            start = time.monotonic()
            requests.get(f"{server.base}/health", timeout=30).raise_for_status()
            health.append(time.monotonic() - start)

    poller = threading.Thread(target=poll)
    poller.start()
    start = time.monotonic()
    r = chat(server, max_tokens=2, structured_outputs={"choice": [f"c{i}" for i in range(100_000)]})
    elapsed = time.monotonic() - start
    small = chat(server, max_tokens=2)
    poller.join()
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs" and "4096" in r.text
    assert elapsed < 3.0 and small.status_code == 200
    assert max(health) < 1.0, health


@pytest.mark.parametrize(
    "so",
    [
        {"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": LOOP}}},
        {"json": {"$ref": "#"}},
        {"grammar": 'start: "a" <|no_such_token|>'},
        {"grammar": 'start: "a" <[99999]>'},
    ],
)
def test_grammars_that_cannot_run_are_400s(server, so):
    r = chat(server, max_tokens=4, structured_outputs=so)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "structured_outputs"


def test_2001_choices_give_a_choice(server):
    words = [f"item{i}" for i in range(2001)]
    r = chat(server, max_tokens=12, n=2, structured_outputs={"choice": words})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["message"]["content"] in words and c["finish_reason"] == "stop", c


def test_required_one_property_tool_has_no_extra_key(server):
    r = chat(
        server,
        max_tokens=60,
        temperature=1.0,
        seed=3,
        n=3,
        tools=[RUN_BASH],
        tool_choice="required",
        messages=[{"role": "user", "content": "List the files in /tmp with their file_path."}],
    )
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        for call in c["message"].get("tool_calls") or []:
            args = json.loads(call["function"]["arguments"])
            assert set(args) <= {"command"}, args
        text = c["message"].get("content") or ""  # a list of calls cut by max_tokens
        assert '"file_path"' not in text, text
        assert all(part.count('"command"') <= 1 for part in text.split('"arguments"')), text
