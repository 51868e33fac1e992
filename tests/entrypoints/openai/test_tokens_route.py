"""vLLM's scale-out routes (--enable-scale-out) on a tiny random model: a request's
/render body, sent to /inference/v1/generate, runs what the request itself runs; tokens
and text modes, streams, logprobs as ids, aborts by request_id, and their 400s."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from tests.entrypoints.test_generation_config import tiny_model
from tests.utils import RemoteServer
from vllm.transformers_utils.tokenizer import get_tokenizer

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Name three rivers."}]
GREEDY = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = tiny_model(path / "model")
    server = RemoteServer(
        "--model", model, "--served-model-name", "tiny", "--max-model-len", "300",
        "--enable-scale-out", log_path=str(path / "server.log"),
        env={"VLLM_SERVER_DEV_MODE": "1"},  # and dev mode's /abort_requests
    )  # fmt: skip
    try:
        yield server, get_tokenizer(model)
    finally:
        server.stop()


def post(server, route: str, body: dict, **kw) -> requests.Response:
    return requests.post(f"{server.base}/{route}", json=body, timeout=60, **kw)


def events(response: requests.Response) -> list[dict]:
    lines = [line[6:] for line in response.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_rendered_chat_generates_what_the_chat_route_generates(served):
    server, tokenizer = served
    chat = {"messages": MESSAGES, **GREEDY, "return_token_ids": True, "job_id": "agent-1"}
    body = post(server, "v1/chat/completions/render", chat).json()
    assert body["model"] == "tiny" and body["return_token_ids"] is True
    params = body["sampling_params"]
    assert params["temperature"] == 0.0 and params["max_tokens"] == 6
    assert params["extra_args"] == {"job_id": "agent-1"}
    full = post(server, "v1/chat/completions", chat).json()
    reply = full["choices"][0]
    out = post(server, "inference/v1/generate", body).json()
    assert out["request_id"].startswith("generate-tokens-") and out["output_mode"] == "tokens"
    [choice] = out["choices"]
    assert choice["token_ids"] == reply["token_ids"] and "text" not in choice
    assert choice["finish_reason"] == reply["finish_reason"]
    assert out["prompt_token_ids"] == body["token_ids"] == full["prompt_token_ids"]
    assert out["usage"]["prompt_tokens"] == len(body["token_ids"])
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"])
    # Text mode: the detokenized output too, and logprobs named by their text.
    text = post(server, "inference/v1/generate",
                {**body, "output_mode": "text",
                 "sampling_params": {**params, "logprobs": 2}}).json()  # fmt: skip
    [choice] = text["choices"]
    assert choice["text"] == reply["message"]["content"]
    assert [e["token"] for e in choice["logprobs"]["content"]] == [
        tokenizer.decode([t]) for t in choice["token_ids"]
    ]


def test_completion_messages_and_responses_render_the_same_prompt(served):
    server, _ = served
    chat = post(server, "v1/chat/completions/render", {"messages": MESSAGES}).json()
    messages = post(
        server, "v1/messages/render", {"model": "tiny", "max_tokens": 6, "messages": MESSAGES}
    ).json()
    responses = post(server, "v1/responses/render", {"input": MESSAGES[0]["content"]}).json()
    assert messages["token_ids"] == chat["token_ids"] == responses["token_ids"]
    assert messages["sampling_params"]["max_tokens"] == 6
    batch = post(server, "v1/completions/render",
                 {"prompt": ["Hello there", "Bye"], "max_tokens": 3, "seed": 1}).json()  # fmt: skip
    assert len(batch) == 2 and batch[0]["sampling_params"]["seed"] == 1
    ids = post(server, "v1/completions/render", {"prompt": [[5, 6, 7], [8]]}).json()
    assert [b["token_ids"] for b in ids] == [[5, 6, 7], [8]]
    completion = post(server, "v1/completions",
                      {"prompt": "Hello there", "max_tokens": 3, "temperature": 0.0,
                       "return_token_ids": True}).json()["choices"][0]  # fmt: skip
    assert batch[0]["token_ids"] == completion["prompt_token_ids"]
    # Beam search is several engine requests a step: its body says so, and is refused.
    beams = post(server, "v1/completions/render",
                 {"prompt": "Hi", "use_beam_search": True, "n": 2, "temperature": 0.0})  # fmt: skip
    refused = post(server, "inference/v1/generate", beams.json()[0])
    assert refused.status_code == 400 and "use_beam_search" in refused.text


def test_a_stream_carries_the_same_tokens_and_ids_logprobs(served):
    server, _ = served
    body = {"token_ids": [1, 17, 29, 40], "sampling_params": {**GREEDY, "logprobs": 3},
            "return_token_ids": True}  # fmt: skip
    whole = post(server, "inference/v1/generate", body).json()["choices"][0]
    lp = whole["logprobs"]["content"][0]
    assert lp["token_id"] == whole["token_ids"][0] and lp["rank"] == 1  # greedy: the best
    assert [t["rank"] for t in lp["top_logprobs"]] == [1, 2, 3]
    assert lp["top_logprobs"][0]["token_id"] == lp["token_id"]
    streamed = post(
        server, "inference/v1/generate",
        {**body, "stream": True, "stream_options": {"include_usage": True}}, stream=True,
    )  # fmt: skip
    chunks = events(streamed)
    assert chunks[0]["prompt_token_ids"] == [1, 17, 29, 40]
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == whole["token_ids"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert [ch["finish_reason"] for c in chunks[:-1] for ch in c["choices"]][-1] == "length"


def test_abort_requests_ends_a_request_by_its_request_id(served):
    server, _ = served
    params = {"max_tokens": 250, "ignore_eos": True, "temperature": 0.0}
    long = {"token_ids": [1, 2, 3], "request_id": "rollout-7", "stream": True,
            "sampling_params": params}  # fmt: skip
    got: list[dict] = []

    def read() -> None:
        got.extend(events(post(server, "inference/v1/generate", long, stream=True)))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    aborted = {"aborted": 0}
    while aborted["aborted"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        aborted = post(server, "inference/v1/abort_requests",
                       {"request_ids": ["generate-tokens-rollout-7"]}).json()  # fmt: skip
    reader.join(30)
    assert aborted == {"status": "aborted", "aborted": 1} and not reader.is_alive()
    assert got[-1]["request_id"] == "generate-tokens-rollout-7"
    assert got[-1]["choices"][0]["finish_reason"] == "abort"
    assert 0 < sum(len(ch["token_ids"]) for c in got for ch in c["choices"]) < 250
    # Unknown ids are skipped; the server goes on.
    none = post(server, "inference/v1/abort_requests", {"request_ids": ["nobody"]})
    assert none.json()["aborted"] == 0
    # Dev mode's /abort_requests (vLLM's RL route): no ids stops every request.
    got.clear()
    reader = threading.Thread(target=read)
    reader.start()
    deadline, aborted = time.monotonic() + 30, {"aborted": 0}
    while aborted["aborted"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        aborted = post(server, "abort_requests", {}).json()
    reader.join(30)
    assert aborted["aborted"] == 1 and got[-1]["choices"][0]["finish_reason"] == "abort"
    again = post(server, "inference/v1/generate", {"token_ids": [1, 2, 3],
                 "sampling_params": GREEDY})  # fmt: skip
    assert again.status_code == 200 and len(again.json()["choices"][0]["token_ids"]) == 6


def test_render_generate_derender_answers_what_the_route_answers(served):
    server, _ = served
    first = post(server, "v1/chat/completions", {"messages": MESSAGES, **GREEDY, "max_tokens": 12})
    content = first.json()["choices"][0]["message"]["content"]
    stop = content[4:7]  # ends the reply inside its text: the cut comes back the same
    for extra in ({}, {"stop": [stop]}, {"logprobs": True, "top_logprobs": 2}):
        chat = {"messages": MESSAGES, **GREEDY, "max_tokens": 12, **extra}
        expected = post(server, "v1/chat/completions", chat).json()
        body = post(server, "v1/chat/completions/render", chat).json()
        out = post(server, "inference/v1/generate", body).json()
        back = post(server, "v1/chat/completions/derender",
                    {"generate_response": out, "prompt_token_ids": body["token_ids"],
                     "chat_request": chat}).json()  # fmt: skip
        for key in ("choices", "usage", "model", "object"):
            assert back[key] == expected[key], (extra, key)
    assert expected["choices"][0]["logprobs"] is not None
    prompts = {"prompt": ["Hello there", "Bye now"], **GREEDY, "logprobs": 1}
    expected = post(server, "v1/completions", prompts).json()
    bodies = post(server, "v1/completions/render", prompts).json()
    outs = [post(server, "inference/v1/generate", b).json() for b in bodies]
    back = post(server, "v1/completions/derender",
                {"generate_responses": outs, "completion_request": prompts,
                 "prompt_token_ids": [b["token_ids"] for b in bodies]}).json()  # fmt: skip
    for got, want in zip(back["choices"], expected["choices"], strict=True):
        # The route ran both prompts in one batch, generate one at a time: the logprobs
        # agree to float error, the rest exactly.
        got_lp, want_lp = got.pop("logprobs"), want.pop("logprobs")
        assert got == want and got_lp["tokens"] == want_lp["tokens"]
        assert got_lp["token_logprobs"] == pytest.approx(want_lp["token_logprobs"], abs=1e-3)
    assert back["usage"]["prompt_tokens"] == sum(len(b["token_ids"]) for b in bodies)
    bad = post(server, "v1/chat/completions/derender",
               {"generate_response": outs[0], "chat_request": {"messages": "x"}})  # fmt: skip
    assert bad.status_code == 400 and "chat_request" in bad.json()["error"]["param"]


def derender_stream(server, route: str, chunks: list[dict], **fields) -> list[dict]:
    """Each generate chunk through the streaming /derender, the state carried along."""
    out, state = [], None
    for chunk in chunks:
        body = {"stream": True, "generate_chunk": chunk, "stream_state": state, **fields}
        answer = post(server, route, body).json()
        out.append(answer["chunk"])
        state = answer["stream_state"]
    return out


def test_a_streamed_generate_derendered_chunk_by_chunk_reads_as_the_stream(served):
    server, _ = served
    first = post(server, "v1/chat/completions", {"messages": MESSAGES, **GREEDY, "max_tokens": 12})
    content = first.json()["choices"][0]["message"]["content"]
    for stop in ([], [content[5:8]]):
        chat = {"messages": MESSAGES, **GREEDY, "max_tokens": 12, "stop": stop}
        expected = post(server, "v1/chat/completions", chat).json()["choices"][0]
        body = post(server, "v1/chat/completions/render", chat).json()
        options = {"include_usage": True}
        gen = {**body, "stream": True, "stream_options": options, "return_token_ids": True}
        chunks = events(post(server, "inference/v1/generate", gen, stream=True))
        got = derender_stream(server, "v1/chat/completions/derender", chunks,
                              chat_request=chat)  # fmt: skip
        assert got[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-1])
        assert text == expected["message"]["content"], stop
        assert got[-2]["choices"][0]["finish_reason"] == expected["finish_reason"]
        usage = got[-1]["usage"]
        assert got[-1]["choices"] == [] and usage["prompt_tokens"] == len(body["token_ids"])
    prompt = {"prompt": "Hello there", **GREEDY, "echo": True}
    expected = post(server, "v1/completions", prompt).json()["choices"][0]["text"]
    [body] = post(server, "v1/completions/render", prompt).json()
    chunks = events(post(server, "inference/v1/generate", {**body, "stream": True}, stream=True))
    got = derender_stream(server, "v1/completions/derender", chunks, completion_request=prompt,
                          prompt_token_ids=body["token_ids"])  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in got) == expected
    bad = post(server, "v1/completions/derender",
               {"stream": True, "generate_chunk": chunks[0],
                "stream_state": {"output_token_ids": [1], "output_chunk_lens": [2]}})  # fmt: skip
    assert bad.status_code == 400 and "stream_state" in bad.text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"token_ids": [1, -2]}, "token_ids"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1], "sampling_params": {"logits_processors": []}}, "logits_processors"),
        ({"token_ids": [1], "sampling_params": {"temperature": "0"}}, "temperature"),
        ({"token_ids": [1], "sampling_params": {"top_p": 2.0}}, "sampling_params.top_p"),
        ({"token_ids": [1], "sampling_params": {"n": 10_000}}, "sampling_params.n"),
        ({"token_ids": [1], "features": {"mm_hashes": {}}}, "features"),
        ({"token_ids": [1], "kv_transfer_params": {"x": 1}}, "kv_transfer_params"),
        (
            {"token_ids": [1], "output_mode": "text", "sampling_params": {"detokenize": False}},
            "output_mode",
        ),
        ({"token_ids": [1], "model": "other"}, "model"),
        ({"token_ids": [1] * 400}, None),
    ],
)
def test_bad_generate_requests_are_4xx_naming_the_field(served, body, param):
    server, _ = served
    response = post(server, "inference/v1/generate", body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    if param is not None:
        assert param in (error.get("param") or "") + error["message"], error


def test_dev_mode_server_info(served):
    server, _ = served
    text = requests.get(f"{server.base}/server_info", timeout=30).json()
    assert "max_model_len=300" in text["vllm_config"].replace(" ", "")
    assert text["vllm_env"]["VLLM_SERVER_DEV_MODE"] is True
    assert not any(w in k for k in text["vllm_env"] for w in ("KEY", "TOKEN", "SECRET"))
    assert text["system_env"]["torch_version"] and text["system_env"]["cpu_count"] >= 1
    info = requests.get(f"{server.base}/server_info?config_format=json", timeout=30).json()
    assert info["vllm_config"]["scheduler_config"]["max_model_len"] == 300
    bad = requests.get(f"{server.base}/server_info?config_format=yaml", timeout=30)
    assert bad.status_code == 400
