"""The job identity vllm-router's clients send (docs/router.md): ``X-Session-ID`` (the key
its ``consistent_hash`` hashes first) and ``vllm_xargs.agentic_context.program_id`` (its
Program) name the job when no ``job_id`` / ``prompt_cache_key`` does; the fields the
router adds to every body it forwards are accepted silently; ``/get_load`` answers its
``power_of_two``, ``/v1/chat/completions/render`` its ``cache_aware``; each /v1 response
names the server that answered (``x-vllm-instance``)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from types import SimpleNamespace

import pytest
from starlette.datastructures import Headers

from vllm.config import LoRAConfig
from vllm.entrypoints.openai.api_server import INSTANCE_HEADER, build_app, instance_id
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.job_identity import (
    PROGRAM_ID_PARAM,
    XARGS_SESSION_PARAM,
    name_the_job,
    read_headers,
)
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.openai.protocol_responses import ResponsesRequest
from vllm.exceptions import VLLMValidationError

MESSAGES = [{"role": "user", "content": "hi"}]
# What vllm-router 0.1.17 adds to a chat body it forwards (seen on a recording worker).
ROUTER_CHAT_DEFAULTS = {
    "stream": False,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
ROUTER_COMPLETION_DEFAULTS = {
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def named(request, headers=None, max_length: int = 256) -> tuple[str | None, str | None]:
    source = name_the_job(request, Headers(headers or {}), max_length)
    return source, request.job_id


AGENTIC = {"agentic_context": {"program_id": "prog-1", "session_id": "s"}}
# What run_sweep's --identity program_id sends (the router forwards it unchanged).
PROGRAM_TURN = {
    "agentic_context": {
        "program_id": "job_0001",
        "session_id": "job_0001",
        "step_id": 3,
        "expected_resume": False,
    }
}


@pytest.mark.parametrize(
    "fields, headers, expected",
    [
        ({}, {}, (None, None)),
        ({}, {"X-Session-ID": "sess-1"}, ("X-Session-ID", "sess-1")),
        ({}, {"x-session-id": "sess-1"}, ("X-Session-ID", "sess-1")),  # case-insensitive
        ({}, {"X-Session-ID": ""}, (None, None)),  # empty: no job, as the router skips it
        ({"vllm_xargs": AGENTIC}, {"X-Session-ID": "s"}, (PROGRAM_ID_PARAM, "prog-1")),
        ({"vllm_xargs": PROGRAM_TURN}, {"X-Session-ID": "x"}, (PROGRAM_ID_PARAM, "job_0001")),
        ({"prompt_cache_key": "k", "vllm_xargs": AGENTIC}, {}, ("prompt_cache_key", "k")),
        ({"job_id": "j", "prompt_cache_key": "k"}, {"X-Session-ID": "s"}, ("job_id", "j")),
        ({"vllm_xargs": {"job_id": "j"}}, {"X-Session-ID": "s"}, ("job_id", "j")),
        # vLLM's own session identity: the body's, then the header, then vllm_xargs'.
        ({"session_id": "b", "vllm_xargs": AGENTIC}, {"X-Session-ID": "h"}, ("session_id", "b")),
        ({"prompt_cache_key": "k", "session_id": "b"}, {}, ("prompt_cache_key", "k")),
        ({"vllm_xargs": {"session_id": "x"}}, {"X-Session-ID": "h"}, ("X-Session-ID", "h")),
        ({"vllm_xargs": {"session_id": "x"}}, {}, (XARGS_SESSION_PARAM, "x")),
        # Keys of a user, a tenant or one request are not jobs: never pinned by.
        ({"user": "u"}, {"X-User-ID": "u", "X-Request-ID": "r"}, (None, None)),
    ],
)
def test_precedence_job_id_then_cache_key_then_session_then_program(fields, headers, expected):
    assert named(chat(**fields), headers) == expected


def test_the_identity_reaches_the_engine_as_the_job():
    request = chat(vllm_xargs=AGENTIC)
    named(request, {"X-Session-ID": "s"})
    args = request.to_sampling_params(max_tokens=4, logprobs=None, stream=False).extra_args
    assert args["job_id"] == "prog-1"
    assert args["agentic_context"]["program_id"] == "prog-1"  # left for plugins to read
    completion = CompletionRequest.model_validate({"prompt": "hi"})
    assert named(completion, {"X-Session-ID": "c"}) == ("X-Session-ID", "c")


@pytest.mark.parametrize(
    "xargs",
    [
        {"agentic_context": "prog"},
        {"agentic_context": {"program_id": 7}},
        {"agentic_context": {"program_id": ""}},
    ],
)
def test_a_malformed_program_identity_is_refused_naming_it(xargs):
    with pytest.raises(VLLMValidationError) as info:
        named(chat(vllm_xargs=xargs))
    assert info.value.param.startswith("vllm_xargs.agentic_context")


@pytest.mark.parametrize(
    "fields, param",
    [({"session_id": ""}, "session_id"), ({"vllm_xargs": {"session_id": 3}}, XARGS_SESSION_PARAM)],
)
def test_a_malformed_session_id_is_refused_naming_it(fields, param):
    with pytest.raises(ValueError, match=param):
        named(chat(**fields))


def test_vllm_s_request_headers_name_the_request_and_set_its_priority():
    request = chat(request_id="body-id", priority=1, session_id="s")
    headers = {"X-Request-Id": "header-id", "X-Vllm-Priority": "-3"}
    assert read_headers(request, Headers(headers), 256) == "session_id"
    assert (request.request_id, request.priority, request.job_id) == ("header-id", -3, "s")
    plain = chat(request_id="body-id", priority=1)
    read_headers(plain, Headers({}), 256)
    assert (plain.request_id, plain.priority, plain.job_id) == ("body-id", 1, None)
    for bad, param in (({"X-Vllm-Priority": "high"}, "X-Vllm-Priority"),
                       ({"X-Request-Id": "r" * 257}, "X-Request-Id")):  # fmt: skip
        with pytest.raises(VLLMValidationError) as info:
            read_headers(chat(), Headers(bad), 256)
        assert info.value.param == param


def test_the_job_id_length_bound_applies_naming_the_source():
    with pytest.raises(VLLMValidationError, match="max-job-id-length") as info:
        named(chat(), {"X-Session-ID": "s" * 9}, max_length=8)
    assert info.value.param == "X-Session-ID"
    with pytest.raises(VLLMValidationError) as info:
        named(chat(vllm_xargs={"agentic_context": {"program_id": "p" * 9}}), max_length=8)
    assert info.value.param == PROGRAM_ID_PARAM
    assert named(chat(), {"X-Session-ID": "s" * 8}, max_length=8)[1] == "s" * 8


def test_responses_keep_prompt_cache_key_for_the_chain_and_take_the_session():
    keyed = ResponsesRequest.model_validate({"input": "hi", "prompt_cache_key": "k"})
    assert named(keyed, {"X-Session-ID": "s"}) == ("prompt_cache_key", None)
    plain = ResponsesRequest.model_validate({"input": "hi"})
    assert named(plain, {"X-Session-ID": "s"}) == ("X-Session-ID", "s")
    session = ResponsesRequest.model_validate({"input": "hi", "session_id": "b"})
    assert named(session, {"X-Session-ID": "s"}) == ("session_id", "b")


def test_the_fields_the_router_adds_are_accepted_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.entrypoints.openai.protocol"):
        chat(**ROUTER_CHAT_DEFAULTS)
        CompletionRequest.model_validate({"prompt": "hi", **ROUTER_COMPLETION_DEFAULTS})
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]


@pytest.mark.parametrize(
    "field, value",
    [("no_stop_trim", True), ("continue_final_message", True), ("return_hidden_states", True)],
)
def test_what_the_router_would_ask_beyond_its_defaults_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        chat(**{field: value})


class _FakeEngine:
    is_alive = True
    num_unfinished_requests = 3
    engine_load = 3  # what /get_load reports
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=True)
    )

    def stalled_for(self) -> float:
        return 0.0


def _call(app, path: str, method: str = "GET", body: bytes = b""):
    """(status, body, headers) of one request to ``app``."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": headers,
        "query_string": b"",
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    response_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    payload = b"".join(m.get("body", b"") for m in sent if "body" in m)
    return start["status"], payload, response_headers


def _get(app, path: str) -> tuple[int, bytes]:
    return _call(app, path)[:2]


def _app(engine=None, instance: str | None = None):
    config = SimpleNamespace(
        model_config=SimpleNamespace(name="m", served_names=("m",)),
        scheduler_config=SimpleNamespace(max_model_len=64),
        lora_config=LoRAConfig(),
    )
    engine = engine or _FakeEngine()
    return build_app(config, FrontendArgs(), engine, SimpleNamespace(registry=None), None, instance)


def test_get_load_answers_the_router_s_power_of_two():
    status, body = _get(_app(), "/get_load")
    # The router reads the integer "load" (an i64) and nothing else.
    assert status == 200 and json.loads(body) == {"load": 3}


def test_each_v1_response_names_the_server_that_answered():
    # Behind the router (which passes response headers through) the client learns the
    # replica of each turn: run_sweep counts a job's turns that changed replica by it.
    app = _app(instance="127.0.0.1:8001")
    status, _, headers = _call(app, "/v1/models")
    assert status == 200 and headers[INSTANCE_HEADER] == "127.0.0.1:8001"
    status, _, headers = _call(app, "/v1/completions", "POST", b"{")  # errors too
    assert status == 400 and headers[INSTANCE_HEADER] == "127.0.0.1:8001"
    assert INSTANCE_HEADER not in _call(app, "/health")[2]  # /v1 only
    assert INSTANCE_HEADER not in _call(_app(), "/v1/models")[2]  # none given


def test_the_instance_is_the_listening_address():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert instance_id(sock) == f"127.0.0.1:{sock.getsockname()[1]}"
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))  # every address: the host's name tells replicas apart
        assert instance_id(sock) == f"{socket.gethostname()}:{sock.getsockname()[1]}"


class _RenderEngine(_FakeEngine):
    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.calls = []

    def apply_chat_template(
        self, messages, template, add_generation_prompt, tools, kwargs=None, cont=False
    ):
        return "|".join(m["content"] for m in messages) + ("|>" * add_generation_prompt)

    def tokenize(self, prompt, add_special_tokens=True):
        self.calls.append(add_special_tokens)
        return [ord(c) for c in prompt]


def test_render_returns_the_prompt_token_ids_for_the_router_s_cache_aware():
    # vllm-router 0.1.17's cache_aware POSTs the forwarded chat body to every worker's
    # /v1/chat/completions/render and matches prefixes on "token_ids"; without the route
    # it routes every chat to one worker.
    engine = _RenderEngine()
    body = json.dumps({"model": "m", "messages": MESSAGES, **ROUTER_CHAT_DEFAULTS}).encode()
    status, payload, _ = _call(_app(engine), "/v1/chat/completions/render", "POST", body)
    assert status == 200
    rendered = json.loads(payload)  # the /inference/v1/generate body it would run as
    assert rendered["model"] == "m" and rendered["token_ids"] == [ord(c) for c in "hi|>"]
    assert "max_tokens" in rendered["sampling_params"]  # defaults left out
    assert rendered["stream"] is False and rendered["priority"] == 0
    assert engine.calls == [False]  # the template wrote the special tokens
    wrong = json.dumps({"model": "other", "messages": MESSAGES}).encode()
    status, payload, _ = _call(_app(engine), "/v1/chat/completions/render", "POST", wrong)
    assert status == 404 and json.loads(payload)["error"]["code"] == "model_not_found"
    # Checked as for generation: the server's limits apply (here --max-stop-strings).
    stops = json.dumps({"messages": MESSAGES, "stop": ["x"] * 33}).encode()
    status, payload, _ = _call(_app(engine), "/v1/chat/completions/render", "POST", stops)
    assert status == 400 and json.loads(payload)["error"]["param"] == "stop"


def test_scale_out_routes_are_403_without_the_flag():
    # vLLM's: /inference/v1/generate and the other /render routes need --enable-scale-out.
    body = json.dumps({"token_ids": [1, 2]}).encode()
    for path in ("/inference/v1/generate", "/v1/completions/render", "/v1/messages/render"):
        status, payload, _ = _call(_app(), path, "POST", body)
        assert status == 403, path
        assert json.loads(payload)["error"]["type"] == "PermissionDeniedError"


def test_the_routes_outside_v1_that_run_or_change_the_engine_need_the_api_key():
    config = SimpleNamespace(
        model_config=SimpleNamespace(name="m", served_names=("m",)),
        scheduler_config=SimpleNamespace(max_model_len=64),
        lora_config=LoRAConfig(),
    )
    args = FrontendArgs(api_key="k")
    app = build_app(config, args, _FakeEngine(), SimpleNamespace(registry=None), None, None)
    for path in ("/inference/v1/generate", "/inference/v1/abort_requests", "/classify",
                 "/pooling", "/pause", "/resume", "/sleep", "/reset_prefix_cache",
                 "/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
                 "/start_weight_update", "/update_weights", "/finish_weight_update",
                 "/update_weight_version", "/weight_checker"):  # fmt: skip
        assert _call(app, path, "POST", b"{}")[0] == 401, path
    for path in ("/weight_info", "/get_world_size"):
        assert _call(app, path)[0] == 401, path
    assert _call(app, "/health")[0] == 200
