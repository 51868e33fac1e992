"""Unit tests of the front end's protections (issue 16): FrontendArgs, the request limits,
unsupported parameters, safe log values, the middleware, /health and /openapi.json."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from vllm.config import LoRAConfig
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.launcher import ServerShuttingDownError, ServerState
from vllm.entrypoints.openai.api_server import ServerMiddleware, build_app, health_status
from vllm.entrypoints.openai.cli_args import FrontendArgs, frontend_args
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    loggable,
)
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.exceptions import VLLMValidationError

MESSAGES = [{"role": "user", "content": "hi"}]


def test_frontend_flags_default_to_their_fields():
    args = make_parser().parse_args(["serve"])
    assert FrontendArgs.from_cli_args(args) == FrontendArgs()
    flags = {a.flag for a in frontend_args()}
    assert {
        "--trust-request-chat-template",
        "--max-request-body-size",
        "--max-n-sequences",
        "--max-stop-strings",
        "--max-stop-string-length",
        "--max-job-id-length",
        "--request-read-timeout",
        "--engine-stall-timeout",
        "--shutdown-timeout",
        "--keep-alive-on-engine-death",
        "--disable-log-requests",
    } <= flags
    args = make_parser().parse_args(["serve", "--max-request-body-size", "1MiB"])
    assert FrontendArgs.from_cli_args(args).max_request_body_size == 1 << 20


@pytest.mark.parametrize(
    "field,value",
    [
        ("port", 70000),
        ("max_n_sequences", 0),
        ("max_request_body_size", 0),
        ("max_stop_strings", -1),
        ("engine_stall_timeout", 0),
        ("request_read_timeout", float("nan")),
        ("shutdown_timeout", -1),
    ],
)
def test_frontend_args_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        FrontendArgs(**{field: value})


def test_loggable_escapes_and_bounds():
    assert loggable("a\nINFO forged\r\x1b[0m") == "'a\\nINFO forged\\r\\x1b[0m'"
    long = loggable("x" * 10**6, limit=10)
    assert long == "'xxxxxxxxxx'... (1000000 chars)"
    assert loggable(None) == "None"


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"best_of": 2}, "best_of"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
        # Implemented on chat (tool_calling.py), refused on completions:
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"extra_body": {"include_reasoning": "yes"}}, "include_reasoning"),
    ],
)
def test_unsupported_parameters_are_refused_naming_them(fields, param):
    request = ChatCompletionRequest
    if param in ChatCompletionRequest.IMPLEMENTED:
        request, fields = CompletionRequest, {"prompt": "hi", **fields}
    else:
        fields = {"messages": MESSAGES, **fields}
    with pytest.raises(ValidationError) as info:
        request.model_validate(fields)
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, VLLMValidationError) and cause.param == param


def test_values_that_ask_for_nothing_are_accepted_and_unknown_fields_warned(caplog):
    ChatCompletionRequest.model_validate(
        {
            "messages": MESSAGES,
            "tools": [{"type": "function"}],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logit_bias": {},
            "best_of": 1,
            "prompt_logprobs": None,
        }
    )
    with caplog.at_level(logging.WARNING):
        CompletionRequest.model_validate({"prompt": "p", "echo": True, "x\ny": 1})
    assert "Request fields ignored (not recognised): 'x\\ny'" in caplog.text


def _serving(**limits) -> OpenAIServing:
    return OpenAIServing(None, "m", args=FrontendArgs(**limits))


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"n": 5}, "n"),
        ({"job_id": "j" * 11}, "job_id"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop": "x" * 9}, "stop"),
    ],
)
def test_request_limits(fields, param):
    serving = _serving(
        max_n_sequences=4, max_job_id_length=10, max_stop_strings=2, max_stop_string_length=8
    )
    with pytest.raises(VLLMValidationError) as info:
        serving.check_request(CompletionRequest.model_validate({"prompt": "p", **fields}))
    assert info.value.param == param
    at_limit = {"n": 4, "job_id": "j" * 10, "stop": ["x" * 8, "y"]}
    serving.check_request(CompletionRequest.model_validate({"prompt": "p", **at_limit}))


def test_prompt_logprobs_reach_sampling_params_but_not_in_a_stream():
    for request in (
        CompletionRequest.model_validate({"prompt": "p", "prompt_logprobs": 3}),
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "prompt_logprobs": 3}),
    ):
        assert request.to_sampling_params(4, None, stream=False).prompt_logprobs == 3
        with pytest.raises(VLLMValidationError) as info:
            request.to_sampling_params(4, None, stream=True)  # as vLLM
        assert info.value.param == "prompt_logprobs"
    # Past -1 is no count at all (the bound above is the engine's --max-logprobs).
    request = CompletionRequest.model_validate({"prompt": "p", "prompt_logprobs": -2})
    with pytest.raises(VLLMValidationError, match="prompt_logprobs"):
        request.to_sampling_params(4, None, stream=False)


def test_server_state_refuses_new_engine_requests_once_closing():
    state = ServerState()
    state.check_open()
    state.closing = True
    with pytest.raises(ServerShuttingDownError):
        state.check_open()


def _asgi_call(app, path: str, headers: dict[str, str], chunks: list[bytes]):
    """Run ``app`` on one HTTP request; (status, body) of its response."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


async def _read_body_app(scope, receive, send):
    # Reads the whole body, as FastAPI does, then answers 200 (or 413 if the limit hit).
    from vllm.entrypoints.openai.api_server import BodyTooLarge

    try:
        while (await receive()).get("more_body"):
            pass
    except BodyTooLarge:
        status = 413
    else:
        status = 200
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_middleware_bounds_the_body_and_refuses_while_draining():
    state = ServerState()
    app = ServerMiddleware(_read_body_app, FrontendArgs(max_request_body_size=10), state)
    status, body = _asgi_call(app, "/v1/completions", {"content-length": "11"}, [b"x" * 11])
    assert status == 413 and b"RequestTooLargeError" in body
    assert _asgi_call(app, "/v1/completions", {}, [b"x" * 6, b"x" * 5])[0] == 413
    assert _asgi_call(app, "/v1/completions", {}, [b"x" * 5, b"x" * 5])[0] == 200
    assert state.active == 0
    state.draining = True
    status, body = _asgi_call(app, "/v1/completions", {}, [b"{}"])
    assert status == 503 and b"ServiceUnavailableError" in body
    assert _asgi_call(app, "/health", {}, [b""])[0] == 200  # not /v1: not refused


class _FakeEngine:
    is_alive = True
    num_unfinished_requests = 2
    stalled = 0.0

    def stalled_for(self) -> float:
        return self.stalled


def test_health_status():
    engine, args, state = _FakeEngine(), FrontendArgs(engine_stall_timeout=5), ServerState()
    assert health_status(engine, args, state) is None
    engine.stalled = 6.0
    assert "stalled" in health_status(engine, args, state)
    engine.stalled = 0.0
    state.draining = True
    assert health_status(engine, args, state) == "shutting down"
    engine.is_alive = False
    assert health_status(engine, args, state) == "engine dead"


def _app_parts(**limits) -> tuple:
    config = SimpleNamespace(
        model_config=SimpleNamespace(name="m", served_names=("m",)),
        scheduler_config=SimpleNamespace(max_model_len=64),
        lora_config=LoRAConfig(),
    )
    stats = SimpleNamespace(registry=None)
    return config, FrontendArgs(**limits), _FakeEngine(), stats


def _openapi(**limits) -> dict:
    return build_app(*_app_parts(**limits)).openapi()


def test_openapi_documents_errors_limits_and_content_types():
    schema = _openapi(max_n_sequences=7, max_job_id_length=9, max_stop_strings=3)
    ops = schema["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = ops[path]["post"]["responses"]
        assert {"200", "400", "413", "500", "503"} <= set(responses) and "422" not in responses
        error_ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error_ref.endswith("/ErrorResponse")
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(ops["/health"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(ops["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    comps = schema["components"]["schemas"]
    assert "HTTPValidationError" not in comps
    completion = comps["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == 7 and completion["n"]["minimum"] == 1
    assert {"type": "string", "minLength": 1} in completion["prompt"]["anyOf"]
    assert any(o.get("maxLength") == 9 for o in completion["job_id"]["anyOf"])
    assert any(o.get("maxItems") == 3 for o in completion["stop"]["anyOf"])
    batches = [o for o in completion["prompt"]["anyOf"] if o.get("type") == "array"]
    assert [o.get("maxItems") for o in batches] == [7, None, 7]  # texts, ids, id lists
    logprobs = next(o for o in completion["logprobs"]["anyOf"] if o.get("type") == "integer")
    assert logprobs == {"type": "integer", "minimum": -1, "maximum": 20}
    chat = comps["ChatCompletionRequest"]["properties"]
    top = next(o for o in chat["top_logprobs"]["anyOf"] if o.get("type") == "integer")
    assert top["maximum"] == 20 and chat["logprobs"]["type"] == "boolean"
    assert chat["chat_template"]["type"] == "null"
    assert chat["messages"]["minItems"] == 1
    trusted = _openapi(trust_request_chat_template=True)["components"]["schemas"]
    assert trusted["ChatCompletionRequest"]["properties"]["chat_template"].get("type") != "null"


def test_chat_templating_runs_in_the_tokenizer_thread():
    # Its cost grows with the messages and the tools, not only the prompt's length: it
    # never runs on the event loop (a 7 MB tool description held it for seconds).
    import threading

    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from vllm.entrypoints.openai.tool_calling import ToolPlan

    threads = []

    def apply_chat_template(
        messages, template, add_generation_prompt, tools, kwargs=None, cont=False
    ):
        threads.append(threading.current_thread().name)
        return f"{len(messages)} messages, tools {tools}"

    engine = SimpleNamespace(
        apply_chat_template=apply_chat_template, chat_template="{{ messages }}"
    )
    serving = OpenAIServingChat(engine, "m")
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES * 3})
    prompt = asyncio.run(serving._prompt(request, ToolPlan()))
    assert prompt == "3 messages, tools None"
    assert threads[0].startswith("tokenizer") and threads[0] != threading.main_thread().name


def test_an_unexpected_error_is_a_json_500():
    app = build_app(*_app_parts())

    @app.get("/v1/boom")
    async def boom():
        raise RuntimeError("internal detail")

    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/boom",
        "headers": [],
        "query_string": b"",
    }
    with pytest.raises(RuntimeError):  # re-raised after the response, for uvicorn's log
        asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 500 and (b"content-type", b"application/json") in start["headers"]
    error = json.loads(body)["error"]
    assert error["type"] == "InternalServerError" and "RuntimeError" in error["message"]
    assert "internal detail" not in error["message"]


def test_message_count_is_bounded_before_validation():
    from vllm.entrypoints.openai.protocol import MAX_CHAT_MESSAGES

    ChatCompletionRequest.model_validate({"messages": MESSAGES * MAX_CHAT_MESSAGES})
    with pytest.raises(ValidationError, match="at most 4096 messages"):
        ChatCompletionRequest.model_validate({"messages": [{}] * (MAX_CHAT_MESSAGES + 1)})
    assert (
        _openapi()["components"]["schemas"]["ChatCompletionRequest"]["properties"]["messages"][
            "maxItems"
        ]
        == MAX_CHAT_MESSAGES
    )


def test_header_limits_are_flags():
    args = FrontendArgs.from_cli_args(
        make_parser().parse_args(
            ["serve", "--max-request-header-size", "8KiB", "--max-request-header-count", "10"]
        )
    )
    assert args.max_request_header_size == 8192 and args.max_request_header_count == 10
    assert FrontendArgs().max_request_header_size == 64 << 10
    with pytest.raises(ValueError, match="max_request_header_count"):
        FrontendArgs(max_request_header_count=0)
