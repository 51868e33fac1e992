"""``vllm serve --skip-tokenizer-init`` (vLLM's): /v1/completions serves token-id prompts
on a model folder without tokenizer files, its choices' text empty and their token ids
returned; a text prompt, and everything else that needs a tokenizer (chat, /tokenize,
/detokenize, stop strings, echo, logprobs named by text, guided decoding), is an
OpenAI-style 400 naming the field, with nothing left in the engine.

The real app and ``AsyncLLM`` (its engine core in its own process) on a tiny random Llama,
started once for the module and driven through ASGI in this process."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
from prometheus_client import CollectorRegistry

from tests.entrypoints.test_skip_tokenizer_init import PROMPT, no_tokenizer_model
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.run_batch import asgi_post
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.prometheus import PrometheusStatLogger

GREEDY = {"model": "tiny", "max_tokens": 5, "temperature": 0.0, "ignore_eos": True}
MESSAGES = [{"role": "user", "content": "hi"}]


class Served:
    """The app over a started engine, on an event loop of its own (kept for the module)."""

    def __init__(self, model: str) -> None:
        self.loop = asyncio.new_event_loop()
        config = EngineArgs(
            model=model, served_model_name=("tiny",), skip_tokenizer_init=True,
            max_model_len=64, num_gpu_blocks_override=32,
        ).create_engine_config(128)  # fmt: skip
        stats = PrometheusStatLogger("tiny", registry=CollectorRegistry())
        self.engine = AsyncLLM(config, stat_loggers=[stats])
        self.loop.run_until_complete(self.engine.start())
        front = FrontendArgs(enable_tokenizer_info_endpoint=True)
        self.app = build_app(config, front, self.engine, stats)

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        return self.loop.run_until_complete(asgi_post(self.app, path, body))

    def get(self, path: str) -> tuple[int, bytes]:
        sent: list[dict] = []

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": path, "headers": [],
                 "query_string": b"", "root_path": ""}  # fmt: skip
        self.loop.run_until_complete(self.app(scope, receive, send))
        body = b"".join(m.get("body", b"") for m in sent)
        return next(m["status"] for m in sent if m["type"] == "http.response.start"), body

    def json(self, path: str, body: dict) -> tuple[int, dict]:
        status, payload = self.post(path, body)
        return status, json.loads(payload)

    def events(self, body: dict) -> list[dict]:
        status, payload = self.post("/v1/completions", {**body, "stream": True})
        assert status == 200
        lines = [line[6:] for line in payload.decode().splitlines() if line.startswith("data:")]
        assert lines[-1] == "[DONE]"
        return [json.loads(line) for line in lines[:-1]]

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = Served(no_tokenizer_model(tmp_path_factory.mktemp("skip") / "m"))
    yield served
    served.close()
    gc.collect()  # the engine's sockets, before the next module's (test_core_proc's reason)


@pytest.fixture
def idle_after(served):
    yield
    assert served.engine.num_unfinished_requests == 0  # nothing orphaned in the engine


def test_token_prompts_return_token_ids_and_empty_text(served, idle_after):
    status, body = served.json("/v1/completions", {**GREEDY, "prompt": PROMPT})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 5
    assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == 3
    # A batch of token prompts: one choice each, numbered as vLLM numbers them.
    status, batch = served.json("/v1/completions", {**GREEDY, "prompt": [PROMPT, [7, 8]]})
    assert status == 200
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["choices"][0]["token_ids"] == choice["token_ids"]  # greedy: the same
    assert batch["choices"][1]["prompt_token_ids"] == [7, 8]
    # Beam search works on ids too (its steps run without text).
    beams = {"model": "tiny", "prompt": PROMPT, "use_beam_search": True, "n": 2,
             "max_tokens": 3, "temperature": 0.0}  # fmt: skip
    status, body = served.json("/v1/completions", beams)
    assert status == 200, body
    assert [c["text"] for c in body["choices"]] == ["", ""]
    assert all(1 <= len(c["token_ids"]) <= 3 for c in body["choices"])


def test_a_stream_carries_the_token_ids(served, idle_after):
    status, body = served.json("/v1/completions", {**GREEDY, "prompt": PROMPT})
    events = served.events({**GREEDY, "prompt": PROMPT})
    choices = [c for e in events for c in e["choices"]]
    assert all(c["text"] == "" for c in choices)
    assert [t for c in choices for t in c["token_ids"]] == body["choices"][0]["token_ids"]
    assert choices[0]["prompt_token_ids"] == PROMPT and choices[-1]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "Hello"}, "prompt"),
        ({"prompt": ["Hello", "World"]}, "prompt"),  # a batch of text prompts
        ({"prompt": PROMPT, "stop": ["x"]}, "stop"),
        ({"prompt": PROMPT, "bad_words": ["x"]}, "bad_words"),
        ({"prompt": PROMPT, "echo": True}, "echo"),
        ({"prompt": PROMPT, "logprobs": 1}, "logprobs"),
        ({"prompt": PROMPT, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"prompt": PROMPT, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ],
)
def test_completions_that_need_a_tokenizer_are_a_400(served, idle_after, body, param):
    for stream in (False, True):
        status, error = served.json("/v1/completions", {**GREEDY, **body, "stream": stream})
        assert status == 400, error
        error = error["error"]
        assert error["param"] == param and error["type"] == "BadRequestError"
        assert "--skip-tokenizer-init" in error["message"]


def test_logprobs_named_by_id_and_prompt_logprobs_without_text(served, idle_after):
    body = {**GREEDY, "prompt": PROMPT, "logprobs": 2, "prompt_logprobs": 1,
            "return_tokens_as_token_ids": True}  # fmt: skip
    status, out = served.json("/v1/completions", body)
    assert status == 200, out
    (choice,) = out["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert logprobs["text_offset"] == [0] * 5  # into the empty text
    # vLLM's: a prompt logprob's decoded_token is null without a tokenizer.
    first, *rest = choice["prompt_logprobs"]
    assert first is None and len(rest) == 2
    assert all(e["decoded_token"] is None for position in rest for e in position.values())


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": MESSAGES}, "messages"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": True}, "messages"),
        ("/v1/chat/completions/render", {"messages": MESSAGES}, "messages"),
        ("/tokenize", {"prompt": "Hello"}, "prompt"),
        ("/tokenize", {"messages": MESSAGES}, "messages"),
        ("/detokenize", {"tokens": PROMPT}, "tokens"),
    ],
)
def test_routes_that_need_a_tokenizer_are_a_400(served, idle_after, path, body, param):
    status, error = served.json(path, {"model": "tiny", **body})
    assert status == 400, error
    assert error["error"]["param"] == param
    assert "--skip-tokenizer-init" in error["error"]["message"]


def test_responses_messages_and_tokenizer_info_are_refused(served, idle_after):
    status, error = served.json("/v1/responses", {"model": "tiny", "input": "hi"})
    assert status == 400 and "--skip-tokenizer-init" in json.dumps(error)
    anthropic = {"model": "tiny", "max_tokens": 4, "messages": MESSAGES}
    status, error = served.json("/v1/messages", anthropic)
    assert status == 400 and "--skip-tokenizer-init" in json.dumps(error)
    status, payload = served.get("/tokenizer_info")
    assert status == 400 and "--skip-tokenizer-init" in payload.decode()
    # Refused requests leave the server serving.
    assert served.post("/v1/completions", {**GREEDY, "prompt": PROMPT})[0] == 200


@pytest.mark.slow
def test_vllm_serve_skip_tokenizer_init_with_the_openai_client(tmp_path):
    # The flag end to end: `vllm serve` starts on a folder without tokenizer files and
    # the official client gets token ids back (vLLM's fields, read from the extras).
    import openai

    from tests.utils import RemoteServer

    model = no_tokenizer_model(tmp_path / "m")
    args = ("--model", model, "--served-model-name", "tiny", "--skip-tokenizer-init",
            "--max-model-len", "64", "--num-gpu-blocks-override", "32")  # fmt: skip
    with RemoteServer(*args, log_path=str(tmp_path / "server.log")) as server:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="EMPTY")
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
        (choice,) = out.choices
        assert choice.text == "" and len(choice.model_extra["token_ids"]) == 3
        with pytest.raises(openai.BadRequestError, match="skip-tokenizer-init"):
            client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        with pytest.raises(openai.BadRequestError, match="skip-tokenizer-init"):
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
