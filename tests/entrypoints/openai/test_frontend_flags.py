"""vLLM's front-end flags that shape the HTTP server: CORS (``--allowed-origins`` and
its kin), ``--root-path``, HTTPS (``--ssl-*``), ``--enable-request-id-headers``,
``--disable-fastapi-docs``, ``--default-chat-template-kwargs`` and
``--enable-force-include-usage``. The app is driven through ASGI with a fake engine; one
end-to-end test serves HTTPS behind a root path with the real model."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from types import SimpleNamespace

import openai
import pytest
import requests

from vllm.config import LoRAConfig
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.protocol import CompletionRequest

from ...utils import RemoteServer

MESSAGES = [{"role": "user", "content": "hi"}]


class _Engine:
    is_alive = True
    num_unfinished_requests = 0
    engine_load = 0
    chat_template = "{{ messages }}"
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=True)
    )

    def __init__(self) -> None:
        self.template_kwargs: list[dict | None] = []

    def stalled_for(self) -> float:
        return 0.0

    def apply_chat_template(
        self, messages, template, add_generation_prompt, tools, kwargs=None, cont=False
    ):
        self.template_kwargs.append(kwargs)
        return "|".join(m["content"] for m in messages)

    def tokenize(self, prompt, add_special_tokens=True):
        return [ord(c) for c in prompt]


def _app(engine=None, **flags):
    config = SimpleNamespace(
        model_config=SimpleNamespace(name="m", served_names=("m",)),
        scheduler_config=SimpleNamespace(max_model_len=64),
        lora_config=LoRAConfig(),
    )
    return build_app(
        config, FrontendArgs(**flags), engine or _Engine(), SimpleNamespace(registry=None)
    )


def _call(app, path: str, method: str = "GET", headers: dict | None = None, body: bytes = b""):
    """(status, body, headers) of one request to ``app``."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    raw += [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    scope = {"type": "http", "method": method, "path": path, "headers": raw, "query_string": b""}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    response_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    payload = b"".join(m.get("body", b"") for m in sent if "body" in m)
    return start["status"], payload, response_headers


def test_the_flags_take_vllm_s_forms():
    args = make_parser().parse_args([
        "serve",
        "--allowed-origins", '["https://a.example", "https://b.example"]',
        "--allowed-methods", "GET", "POST",
        "--allowed-media-domains", "upload.wikimedia.org", "github.com",
        "--allow-credentials",
        "--root-path", "/llm",
        "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--enable-request-id-headers",
        "--enable-force-include-usage",
        "--disable-fastapi-docs",
        "--disable-uvicorn-access-log",
    ])  # fmt: skip
    front = FrontendArgs.from_cli_args(args)
    assert front.allowed_origins == ("https://a.example", "https://b.example")
    assert front.allowed_methods == ("GET", "POST") and front.allowed_headers == ("*",)
    assert front.allowed_media_domains == ("upload.wikimedia.org", "github.com")
    assert front.allow_credentials and front.root_path == "/llm"
    assert front.default_chat_template_kwargs == {"enable_thinking": False}
    assert front.enable_request_id_headers and front.enable_force_include_usage
    assert front.disable_fastapi_docs and front.disable_uvicorn_access_log
    for bad in (
        ["--default-chat-template-kwargs", "[1]"],
        ["--default-chat-template-kwargs", "{nope"],
        ["--allowed-origins", "[1]"],
        ["--ssl-cert-reqs", "3"],
    ):
        with pytest.raises(SystemExit):
            make_parser().parse_args(["serve", *bad])


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"ssl_keyfile": __file__}, "ssl_keyfile and ssl_certfile"),
        ({"ssl_keyfile": __file__, "ssl_certfile": "/no/such.pem"}, "ssl_certfile"),
        ({"ssl_cert_reqs": 2}, "needs HTTPS"),
        ({"root_path": "llm"}, "root_path"),
        ({"root_path": "/llm/"}, "root_path"),
        ({"default_chat_template_kwargs": {"messages": []}}, "default_chat_template_kwargs"),
        ({"allowed_origins": "*"}, "allowed_origins"),
    ],
)
def test_bad_flag_values_are_refused_naming_them(fields, message):
    with pytest.raises(ValueError, match=message):
        FrontendArgs(**fields)


def test_cors_answers_preflights_before_the_api_key_and_marks_refusals():
    app = _app(api_key="k")
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    status, _, headers = _call(app, "/v1/chat/completions", "OPTIONS", preflight)
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    # A browser reads the 401 only if it carries the CORS header too.
    status, _, headers = _call(app, "/v1/models", headers={"Origin": "https://ui.example"})
    assert status == 401 and headers["access-control-allow-origin"] == "*"
    keyed = {"Origin": "https://ui.example", "Authorization": "Bearer k"}
    assert _call(app, "/v1/models", headers=keyed)[0] == 200

    narrow = _app(allowed_origins=("https://ui.example",))
    status, _, headers = _call(narrow, "/v1/models", headers={"Origin": "https://ui.example"})
    assert status == 200 and headers["access-control-allow-origin"] == "https://ui.example"
    evil = {**preflight, "Origin": "https://evil.example"}
    assert _call(narrow, "/v1/chat/completions", "OPTIONS", evil)[0] == 400
    status, _, headers = _call(narrow, "/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in headers


def test_root_path_routes_with_or_without_the_prefix_and_keeps_the_key():
    app = _app(root_path="/llm", api_key="k")
    key = {"Authorization": "Bearer k"}
    # A proxy that leaves the prefix on: still /v1, still behind the key.
    assert _call(app, "/llm/v1/models")[0] == 401
    assert _call(app, "/llm/v1/models", headers=key)[0] == 200
    assert _call(app, "/v1/models", headers=key)[0] == 200
    assert _call(app, "/llm/health")[0] == 200
    schema = json.loads(_call(app, "/openapi.json")[1])
    assert schema["servers"] == [{"url": "/llm"}]


def test_the_schema_says_a_message_may_hold_text_and_image_parts():
    schema = json.loads(_call(_app(), "/openapi.json")[1])
    content = schema["components"]["schemas"]["ChatMessage"]["properties"]["content"]
    parts = next(s for s in content["anyOf"] if s.get("type") == "array")["items"]["anyOf"]
    assert [p["properties"]["type"]["const"] for p in parts] == ["text", "image_url"]
    assert {"type": "string"} in content["anyOf"] and {"type": "null"} in content["anyOf"]


def test_request_id_headers_echo_the_client_s_or_make_one():
    app = _app(enable_request_id_headers=True)
    status, _, headers = _call(app, "/v1/models", headers={"X-Request-Id": "abc-1"})
    assert status == 200 and headers["x-request-id"] == "abc-1"
    made = _call(app, "/health")[2]["x-request-id"]
    assert len(made) == 32 and made != _call(app, "/health")[2]["x-request-id"]
    assert "x-request-id" not in _call(_app(), "/v1/models")[2]


def test_docs_can_be_turned_off():
    assert _call(_app(), "/openapi.json")[0] == 200
    app = _app(disable_fastapi_docs=True)
    assert [_call(app, p)[0] for p in ("/openapi.json", "/docs", "/redoc")] == [404] * 3
    assert _call(app, "/v1/models")[0] == 200


def test_default_chat_template_kwargs_give_way_to_the_request_s():
    engine = _Engine()
    app = _app(engine, default_chat_template_kwargs={"enable_thinking": False, "style": "a"})
    for own in (None, {"style": "b"}):
        body = {"messages": MESSAGES, **({"chat_template_kwargs": own} if own else {})}
        status, payload, _ = _call(
            app, "/v1/chat/completions/render", "POST", body=json.dumps(body).encode()
        )
        assert status == 200, payload
    assert engine.template_kwargs == [
        {"enable_thinking": False, "style": "a"},
        {"enable_thinking": False, "style": "b"},
    ]


def test_force_include_usage_ends_every_stream_with_usage():
    def usage(options, force):
        body = {"prompt": "hi", "stream": True, "stream_options": options}
        return CompletionRequest.model_validate(body).stream_usage(force)

    assert usage(None, False) == (False, False)
    assert usage(None, True) == (True, False)
    assert usage({"include_usage": False}, True) == (True, False)
    assert usage({"include_usage": True, "continuous_usage_stats": True}, False) == (True, True)
    assert usage({"include_usage": False, "continuous_usage_stats": True}, True) == (True, True)


@pytest.mark.slow
def test_https_behind_a_root_path_end_to_end(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test's certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    server = RemoteServer(
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/llm",
        "--api-key", "k", "--enable-force-include-usage", "--enable-request-id-headers",
        "--num-gpu-blocks-override", "64", "--max-model-len", "512", "--max-logprobs", "40",
        "--response-role", "bot", ssl_ca=str(cert),
    )  # fmt: skip
    try:
        assert server.base.startswith("https://")
        client = openai.OpenAI(
            api_key="k",
            base_url=server.base + "/llm/v1",
            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cert)),
            max_retries=0,
        )
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=4, stream=True
        )
        chunks = list(stream)  # no stream_options: the server adds the usage anyway
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
        assert chunks[0].choices[0].delta.role == "bot"  # --response-role
        # SageMaker's /invocations, behind the key and the root path like /v1.
        body = {"messages": MESSAGES, "max_tokens": 3}
        r = requests.post(server.base + "/llm/invocations", json=body, verify=str(cert),
                          headers={"Authorization": "Bearer k"})  # fmt: skip
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        assert r.json()["choices"][0]["message"]["role"] == "bot"
        assert requests.get(server.base + "/llm/ping", verify=str(cert)).status_code == 200
        # --max-logprobs (an engine flag, here too): 30 top logprobs a token, past the
        # default 20; the whole vocabulary (-1) is past 40.
        reply = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2, logprobs=30, temperature=0
        )
        assert [len(t) for t in reply.choices[0].logprobs.top_logprobs] == [30, 30]
        with pytest.raises(openai.BadRequestError, match="max-logprobs"):
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", logprobs=-1)
        r = requests.get(server.base + "/llm/v1/models", verify=str(cert))
        assert r.status_code == 401 and len(r.headers["x-request-id"]) == 32
        with pytest.raises(requests.ConnectionError):  # plain HTTP is not served
            requests.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    finally:
        server.stop()


def test_sagemaker_ping_and_invocations():
    app = _app(api_key="k")
    assert [_call(app, "/ping", m)[0] for m in ("GET", "POST")] == [200, 200]
    assert _call(app, "/invocations", "POST", body=b'{"prompt": "hi"}')[0] == 401  # keyed
    key = {"Authorization": "Bearer k"}

    def invoke(body: bytes) -> tuple[int, dict]:
        status, payload, _ = _call(app, "/invocations", "POST", key, body)
        return status, json.loads(payload)["error"]

    # The body's fields pick the API; each is validated as on its own route.
    assert invoke(b'{"messages": []}')[1]["param"] == "messages"
    assert invoke(b'{"prompt": [1, 2.5]}')[1]["param"] == "prompt"
    assert invoke(b'{"input": 5}')[1]["param"] == "input"
    assert invoke(b'{"query": "q", "documents": [3]}')[1]["param"] == "documents"
    assert invoke(b'{"text_1": "a", "text_2": 4}')[1]["param"] == "text_2"
    status, error = invoke(b'{"model": "m"}')
    assert status == 400 and "chat (messages)" in error["message"]
    assert invoke(b"{nope")[1]["message"] == "Invalid JSON in the request body."


def test_tools_left_out_with_tool_choice_none_and_the_reply_role():
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.tool_calling import ToolCallingConfig, plan_tool_calls

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [tool], "tool_choice": "none"}
    )
    assert plan_tool_calls(request, ToolCallingConfig()).template_tools == [tool]
    hidden = ToolCallingConfig(exclude_tools_when_tool_choice_none=True)
    assert plan_tool_calls(request, hidden).template_tools is None
    plain = ChatCompletionRequest.model_validate({"messages": MESSAGES})
    plan = plan_tool_calls(plain, ToolCallingConfig(response_role="bot"))
    assert plan.message("hello", "stop")[0] == {"role": "bot", "content": "hello"}
    args = FrontendArgs.from_cli_args(
        make_parser().parse_args(["serve", "--exclude-tools-when-tool-choice-none",
                                  "--response-role", "bot"])
    )  # fmt: skip
    config = ToolCallingConfig.from_args(args)
    assert config.exclude_tools_when_tool_choice_none and config.response_role == "bot"
    with pytest.raises(ValueError, match="response_role"):
        FrontendArgs(response_role="")
