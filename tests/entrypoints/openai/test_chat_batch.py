"""vLLM's POST /v1/chat/completions/batch on a tiny random model: each choice is what the
chat route answers its conversation, the usage sums them, vLLM's limits are 400s naming
the field, a bad conversation runs nothing, and a client that leaves aborts them all."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from tests.entrypoints.test_generation_config import tiny_model
from tests.utils import RemoteServer

pytestmark = pytest.mark.slow
CONVERSATIONS = [
    [{"role": "user", "content": "Name three rivers."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "Count to five, please, slowly and in words."}],
]
GREEDY = {"temperature": 0.0, "max_tokens": 6}
MAX_CONVERSATIONS = 4  # the server's --max-n-sequences


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = tiny_model(path / "model")
    server = RemoteServer(
        "--model", model, "--served-model-name", "tiny", "--max-model-len", "300",
        "--max-n-sequences", str(MAX_CONVERSATIONS), log_path=str(path / "server.log"),
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def post(server, route: str, body: dict) -> requests.Response:
    return requests.post(f"{server.base}/{route}", json=body, timeout=60)


def test_each_choice_is_the_chat_routes_reply_and_the_usage_sums(server):
    extra = {**GREEDY, "return_token_ids": True, "logprobs": True, "job_id": "agent-1"}
    batch = post(server, "v1/chat/completions/batch",
                 {"messages": CONVERSATIONS, "request_id": "fan-out", **extra})  # fmt: skip
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert body["id"] == "chatcmpl-fan-out" and body["object"] == "chat.completion"
    assert body["model"] == "tiny" and len(body["choices"]) == len(CONVERSATIONS)
    prompt = completion = 0
    for i, (conversation, choice) in enumerate(zip(CONVERSATIONS, body["choices"], strict=True)):
        single = post(server, "v1/chat/completions", {"messages": conversation, **extra}).json()
        [reply] = single["choices"]
        assert choice["index"] == i
        assert choice["message"] == reply["message"]
        assert choice["token_ids"] == reply["token_ids"]
        assert choice["prompt_token_ids"] == single["prompt_token_ids"]
        # The same tokens; their logprobs to rounding (a batch of 3 is not a batch of 1).
        got, want = choice["logprobs"]["content"], reply["logprobs"]["content"]
        assert [e["token"] for e in got] == [e["token"] for e in want]
        assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in want], abs=1e-3)
        assert choice["finish_reason"] == reply["finish_reason"]
        prompt += single["usage"]["prompt_tokens"]
        completion += single["usage"]["completion_tokens"]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, completion)
    assert usage["total_tokens"] == prompt + completion


@pytest.mark.parametrize(
    "field, value",
    [
        ("stream", True),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("use_beam_search", True),
        ("n", 2),
        ("temperature", "hot"),  # a shared field: the chat checks apply
    ],
)
def test_a_refused_field_is_a_400_naming_it(server, field, value):
    r = post(server, "v1/chat/completions/batch",
             {"messages": CONVERSATIONS, **GREEDY, field: value})  # fmt: skip
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "BadRequestError"


def test_too_many_conversations_is_a_400(server):
    many = [CONVERSATIONS[0]] * (MAX_CONVERSATIONS + 1)
    r = post(server, "v1/chat/completions/batch", {"messages": many, **GREEDY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "bad",
    [
        [{"role": "user"}, {"content": "no role"}],  # a malformed message
        [{"role": "user", "content": "word " * 400}],  # past --max-model-len, engine's check
    ],
)
def test_a_bad_conversation_in_the_middle_runs_nothing(server, bad):
    before = server.metrics()["vllm:prompt_tokens_total"]
    batch = [CONVERSATIONS[0], bad, CONVERSATIONS[1]]
    r = post(server, "v1/chat/completions/batch", {"messages": batch, **GREEDY})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[1]" and error["message"].startswith("messages[1]")
    assert server.metrics()["vllm:prompt_tokens_total"] == before


def test_a_client_that_leaves_aborts_every_conversation(server):
    body = json.dumps(
        {"messages": CONVERSATIONS[:2], "max_tokens": 250, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/chat/completions/batch HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    try:
        sock.sendall(head + body)
        assert server.wait_metric("vllm:num_requests_running", 2.0) == 2.0
    finally:
        sock.close()
    assert server.wait_metric("vllm:num_requests_running", 0.0) == 0.0
    assert server.wait_metric("vllm:kv_cache_usage_perc", 0.0) == 0.0
