"""End-to-end: bad input is a 400 naming the field, and never harms the server (issue 16)."""

from __future__ import annotations

import json

import pytest
import requests

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
NAN, INF = float("nan"), float("inf")


def _nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


def _content(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


# (endpoint, fields over the base body, the param the 400 must name)
BAD = [
    ("chat", {"temperature": NAN}, "temperature"),
    ("chat", {"temperature": INF}, "temperature"),
    ("completions", {"temperature": -INF}, "temperature"),
    ("chat", {"top_p": NAN}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"top_k": 10**30}, "top_k"),
    ("chat", {"min_p": NAN}, "min_p"),
    ("chat", {"presence_penalty": NAN}, "presence_penalty"),
    ("completions", {"frequency_penalty": INF}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 1e-300}, "repetition_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"repetition_penalty": NAN}, "repetition_penalty"),
    ("chat", {"seed": 18446744073709551616}, "seed"),
    ("chat", {"seed": -(2**63) - 1}, "seed"),
    ("completions", {"seed": 10**30}, "seed"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_tokens"),
    ("chat", {"n": 0}, "n"),
    ("chat", _content("a\ud800b"), "messages"),
    ("completions", {"prompt": "a\ud800b"}, "prompt"),
    ("chat", _content([{"type": "text", "text": 5}]), "messages"),
    ("chat", _content([{"type": "text", "text": None}]), "messages"),
    ("chat", _content(7), "messages"),
    ("chat", {"vllm_xargs": _nested(900)}, "vllm_xargs"),
    ("completions", {"extra_body": {"tools_meta": _nested(900)}}, "tools_meta"),
    # Strict types, as OpenAI: no coercion of strings, booleans or floats.
    ("chat", {"stream": "yes"}, "stream"),
    ("chat", {"temperature": "0.5"}, "temperature"),
    ("completions", {"top_p": "1"}, "top_p"),
    ("completions", {"max_tokens": 2.0}, "max_tokens"),
    ("completions", {"prompt": [1, True]}, "prompt"),
    ("completions", {"prompt": [1.0, 2]}, "prompt"),
    ("completions", {"prompt": [[1, 2.0]]}, "prompt"),
    ("chat", {"stop_token_ids": [True]}, "stop_token_ids"),
    ("chat", {"seed": 1.0}, "seed"),
    ("chat", {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ("completions", {"logit_bias": {"1": True}}, "logit_bias"),
    # OpenAI: "logprobs must be set to true if top_logprobs is used".
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("chat", {"echo": "yes"}, "echo"),
    ("chat", {"continue_final_message": True}, "continue_final_message"),  # with a new turn
    ("completions", {"prompt": ["a", [1]]}, "prompt"),  # text and token ids in one batch
    ("completions", {"prompt": [[1], []]}, "prompt"),  # an empty prompt in a batch
    ("completions", {"prompt": ["a"] * 129}, "prompt"),  # past --max-n-sequences
    ("completions", {"structured_outputs": {"lua": "x"}}, "structured_outputs"),
    ("completions", {"response_format": {"type": "xml"}}, "response_format"),
    (
        "chat",
        {
            "response_format": {
                "type": "structural_tag",
                "triggers": ["<f="],
                "structures": [{"begin": "<g>", "schema": {}, "end": ""}],
            }
        },
        "structured_outputs",
    ),
    (
        "chat",
        {
            "response_format": {
                "type": "structural_tag",
                "format": {"type": "grammar", "grammar": "root ::= x"},
            }
        },
        "structured_outputs",
    ),  # fmt: skip
    ("chat", {"messages": [{"role": "user", "content": "hi"}] * 4097}, "messages"),
]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer("--num-gpu-blocks-override", "64", "--max-model-len", "512")
    try:
        yield srv
    finally:
        srv.stop()


def post(server, endpoint: str, body: dict) -> requests.Response:
    # json.dumps writes NaN/Infinity literals and \ud800 escapes, as a careless client would.
    url = f"{server.base}/v1/{'chat/completions' if endpoint == 'chat' else endpoint}"
    headers = {"Content-Type": "application/json"}
    return requests.post(url, data=json.dumps(body), headers=headers, timeout=60)


def test_bad_inputs_are_400s_naming_the_field(server):
    failures = []
    for endpoint, fields, param in BAD:
        base = CHAT if endpoint == "chat" else COMPLETION
        r = post(server, endpoint, {**base, **fields})
        err = (
            r.json().get("error", {}) if r.headers.get("content-type") == "application/json" else {}
        )
        if r.status_code != 400 or err.get("param") != param or not err.get("message"):
            failures.append((endpoint, str(fields)[:80], r.status_code, r.text[:200]))
    assert not failures
    # Nothing reached the engine, which still serves: every bad request above was refused.
    assert requests.get(server.base + "/health").status_code == 200
    ok = post(server, "chat", {**CHAT, "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    tag = {"type": "structural_tag", "triggers": ["<function="],
           "structures": [{"begin": "<function=f>", "schema": {"type": "object"},
                           "end": "</function>"}]}  # fmt: skip
    tagged = post(server, "chat", {**CHAT, "max_tokens": 4, "response_format": tag})
    assert tagged.status_code == 200, tagged.text
    # xgrammar's format form, as vLLM's examples send it.
    fmt = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<function="],
        "tags": [{"begin": "<function=f>", "content": {"type": "json_schema",
                  "json_schema": {"type": "object"}}, "end": "</function>"}]}}  # fmt: skip
    formatted = post(server, "chat", {**CHAT, "max_tokens": 4, "response_format": fmt})
    assert formatted.status_code == 200, formatted.text


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": 2**63 - 1, "n": 2},  # the child seeds go past int64: still a valid seed
        {"seed": -(2**63)},
        {"repetition_penalty": 0.01, "temperature": 1e-6},
        {"top_k": 10**6, "top_p": 1e-9, "min_p": 1.0},
        {"top_p": 1e-300, "temperature": 1},  # below float32's resolution; an int temperature
        {"prompt": [1, 2, 3], "echo": False},
        {"prompt": [[1, 2], [3]], "n": 2, "echo": True},
        {"extra_body": {"stream": True, "stream_options": {"include_usage": True}}},
    ],
)
def test_extreme_but_valid_values_are_served(server, fields):
    r = post(server, "completions", {**COMPLETION, **fields})
    assert r.status_code == 200, r.text
    assert "error" not in r.text
