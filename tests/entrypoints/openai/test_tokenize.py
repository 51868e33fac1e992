"""vLLM's /tokenize and /detokenize on a tiny random model: text and chat prompts as the
generation routes see them, and their 400s."""

from __future__ import annotations

import pytest
import requests

from tests.entrypoints.test_generation_config import tiny_model
from tests.utils import RemoteServer
from vllm.transformers_utils.tokenizer import get_tokenizer

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model = tiny_model(path / "model")
    server = RemoteServer(
        "--model", model, "--served-model-name", "tiny", "--max-model-len", "300",
        "--enable-tokenizer-info-endpoint", log_path=str(path / "server.log"),
    )  # fmt: skip
    try:
        yield server, get_tokenizer(model)
    finally:
        server.stop()


def post(server, route: str, body: dict) -> requests.Response:
    return requests.post(f"{server.base}/{route}", json=body, timeout=30)


def test_text_prompt_tokens_and_their_strings(served):
    server, tokenizer = served
    text = "The quick brown fox, 42 times."
    body = post(server, "tokenize", {"prompt": text, "return_token_strs": True}).json()
    ids = tokenizer(text).input_ids
    assert body == {
        "count": len(ids),
        "max_model_len": 300,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    plain = post(server, "tokenize", {"prompt": text, "model": "tiny"}).json()
    assert plain["tokens"] == ids and plain["token_strs"] is None
    back = post(server, "detokenize", {"tokens": ids}).json()
    assert back == {"prompt": tokenizer.decode(ids)}


def test_chat_messages_tokenize_as_the_chat_route_renders_them(served):
    server, _ = served
    rendered = post(server, "v1/chat/completions/render", {"messages": MESSAGES}).json()
    body = post(server, "tokenize", {"messages": MESSAGES}).json()
    assert body["tokens"] == rendered["token_ids"] and body["count"] == len(body["tokens"])
    bare = post(server, "tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert len(bare.json()["tokens"]) < body["count"]
    # vLLM's continue_final_message: the last message left open (no end-of-turn tokens).
    begun = [*MESSAGES, {"role": "assistant", "content": "The Nile,"}]
    cont = {"messages": begun, "add_generation_prompt": False, "continue_final_message": True}
    opened = post(server, "tokenize", cont).json()["tokens"]
    closed = post(server, "tokenize", {**cont, "continue_final_message": False}).json()["tokens"]
    assert opened == post(server, "v1/chat/completions/render", cont).json()["token_ids"]
    assert closed[: len(opened)] == opened and len(closed) > len(opened)


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("tokenize", {}, "prompt"),
        ("tokenize", {"prompt": "a", "tools": []}, "tools"),
        ("tokenize", {"prompt": "a", "continue_final_message": True}, "continue_final_message"),
        (
            "tokenize",
            {"messages": MESSAGES, "continue_final_message": True},
            "continue_final_message",
        ),
        ("tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
        ("tokenize", {"messages": []}, "messages"),
        (
            "tokenize",
            {"messages": MESSAGES, "chat_template_kwargs": {"tools": 1}},
            "chat_template_kwargs",
        ),
        ("tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("detokenize", {"tokens": [1, 10**7]}, "tokens"),
        ("detokenize", {"tokens": [-1]}, "tokens"),
        ("detokenize", {"tokens": "12"}, "tokens"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(served, route, body, param):
    server, _ = served
    r = post(server, route, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_tokenizer_info_shows_the_configuration_and_template(served):
    server, tokenizer = served
    info = requests.get(f"{server.base}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["chat_template"] == tokenizer.chat_template
    assert info["eos_token"] == tokenizer.eos_token  # a special token: by its text
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
