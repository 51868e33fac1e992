"""Six more of vLLM's ``vllm serve`` flags: ``--sse-keep-alive-interval``,
``--disable-access-log-for-endpoints``, ``--kv-cache-memory-bytes``, ``--tokens-only``,
``--ssl-ciphers`` and ``--log-error-stack``. Parsed by the real parser; the app is driven
through ASGI with a fake engine (no model, no server process)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import ssl
import subprocess

import pytest

from tests.entrypoints.openai.test_chat_image_parts import _Engine, _Stream
from tests.entrypoints.openai.test_frontend_flags import _app, _call
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints import launcher
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.cli.serve import tokens_only
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.sse import SSE_KEEP_ALIVE_COMMENT, with_sse_keep_alive
from vllm.outputs import CompletionOutput, RequestOutput

KEEP_ALIVE = SSE_KEEP_ALIVE_COMMENT.encode()


def _args(*argv: str):
    return make_parser().parse_args(["serve", *argv])


def _front(*argv: str) -> FrontendArgs:
    return FrontendArgs.from_cli_args(_args(*argv))


# -- --sse-keep-alive-interval ------------------------------------------------------------


async def _events(delays: list[float], closed: list[str]):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            yield f"data: {i}\n\n"
    finally:
        closed.append("events")


def test_keep_alive_fills_only_the_silences_and_ends_with_the_stream():
    async def run(interval: float) -> list[str]:
        closed: list[str] = []
        out = [e async for e in with_sse_keep_alive(_events([0, 0.25, 0], closed), interval)]
        assert closed == ["events"]
        return out

    # 0.25 s of silence at 0.1 s: two comments, between events 0 and 1; 1 and 2 back to back.
    assert asyncio.run(run(0.1)) == ["data: 0\n\n", *[": keep-alive\n\n"] * 2,
                                     "data: 1\n\n", "data: 2\n\n"]  # fmt: skip
    assert asyncio.run(run(0)) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    events = _events([], [])
    assert with_sse_keep_alive(events, 0) is events  # off: the stream itself
    with pytest.raises(ValueError, match="sse_keep_alive_interval must be >= 0"):
        _front("--sse-keep-alive-interval", "-1")
    assert _front("--sse-keep-alive-interval", "15").sse_keep_alive_interval == 15


def test_keep_alive_closed_mid_wait_ends_the_stream_s_read():
    async def run() -> list[str]:
        closed: list[str] = []
        stream = with_sse_keep_alive(_events([3600], closed), 0.05)
        assert await anext(stream) == SSE_KEEP_ALIVE_COMMENT
        await stream.aclose()  # the client left while the request waited
        return closed

    assert asyncio.run(run()) == ["events"]


class _SlowStream(_Stream):
    """A request that waits ``delay`` s (queued, prefilling) before its one output."""

    delay = 0.25
    aborted = False
    _sent = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self._sent:
            raise StopAsyncIteration
        await asyncio.sleep(self.delay)
        self._sent = True
        done = CompletionOutput(0, "ok", [111, 107], finish_reason="stop")
        return RequestOutput("r", None, self.prompt_token_ids, [done], True)

    async def aclose(self) -> None:
        type(self).aborted = True


class _SlowEngine(_Engine):
    async def add_request(self, prompt, params, request_id, priority=0, executor=None, **kw):
        self.added.append((prompt, kw))
        return _SlowStream(prompt if isinstance(prompt, list) else self.tokenize(prompt))


def _stream(app, path: str, body: dict, leave_after: float | None = None) -> bytes:
    """The body of a streamed response; ``leave_after``: the client disconnects then."""
    sent: list[dict] = []
    first = True

    async def receive():
        nonlocal first
        if first:
            first = False
            data = json.dumps(body).encode()
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.sleep(3600 if leave_after is None else leave_after)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers,
             "query_string": b""}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/responses", {"input": "hi", "stream": True}),
        ("/inference/v1/generate", {"token_ids": [1, 2], "stream": True}),
    ],
)
def test_every_openai_stream_sends_comments_while_the_request_waits(path, body):
    app = _app(_SlowEngine(), sse_keep_alive_interval=0.1, enable_scale_out=True)
    out = _stream(app, path, body)
    assert out.count(KEEP_ALIVE) in (1, 2), out  # 0.25 s of waiting at 0.1 s
    events = [e for e in out.split(b"\n\n") if e and not e.startswith(b":")]
    assert events and not any(KEEP_ALIVE in e for e in events)
    assert out.endswith((b"data: [DONE]\n\n", b"\n\n")) and b'"error": {' not in out, out
    quiet = _stream(_app(_SlowEngine(), enable_scale_out=True), path, body)
    assert KEEP_ALIVE not in quiet  # off by default
    assert len([e for e in quiet.split(b"\n\n") if e]) == len(events)  # the same events


def test_messages_keep_alive_is_anthropic_s_ping_at_the_interval():
    body = {"model": "m", "max_tokens": 4, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    out = _stream(_app(_SlowEngine(), sse_keep_alive_interval=0.1), "/v1/messages", body)
    assert out.count(b"event: ping") in (1, 2) and KEEP_ALIVE not in out, out
    assert out.rstrip().endswith(b'"type": "message_stop"}')
    quiet = _stream(_app(_SlowEngine()), "/v1/messages", body)  # 10 s default: none here
    assert b"event: ping" not in quiet


def test_a_client_that_leaves_during_keep_alive_aborts_its_request():
    _SlowStream.aborted = False
    _SlowStream.delay = 3600  # never answers: only comments, until the client leaves
    try:
        app = _app(_SlowEngine(), sse_keep_alive_interval=0.05)
        out = _stream(app, "/v1/chat/completions", CHAT, leave_after=0.2)
    finally:
        _SlowStream.delay = 0.25
    assert out and set(out.split(b"\n\n")) == {b": keep-alive", b""}
    assert _SlowStream.aborted


# -- --disable-access-log-for-endpoints ---------------------------------------------------


def _access_record(path: str) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1,
                             '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5", "GET", path, "1.1", 200), None)  # fmt: skip


def test_access_log_leaves_out_the_paths_given(caplog):
    front = _front("--disable-access-log-for-endpoints", "/health, /metrics", "--root-path", "/llm")
    assert front.access_log_excluded_paths() == {"/health", "/metrics"}
    log_filter = launcher.AccessLogPathFilter(front.access_log_excluded_paths(), "/llm")
    cases = [("/health", False), ("/metrics?x=1", False), ("/llm/health", False),
             ("/healthz", True), ("/v1/models", True), ("/llm/v1/models", True)]  # fmt: skip
    for path, kept in cases:
        assert log_filter.filter(_access_record(path)) is kept, path
    access = logging.getLogger("uvicorn.access")
    with caplog.at_level(logging.INFO, "uvicorn.access"), launcher.access_log_filtered(front):
        for path in ("/health", "/v1/models", "/metrics"):
            record = _access_record(path)
            access.info(record.msg, *record.args)
    assert [r.args[2] for r in caplog.records if r.name == "uvicorn.access"] == ["/v1/models"]
    assert not access.filters  # removed once the server stops
    with pytest.raises(ValueError, match="disable_access_log_for_endpoints must be comma"):
        _front("--disable-access-log-for-endpoints", "health")


# -- --kv-cache-memory-bytes --------------------------------------------------------------


def _cache(*argv: str) -> int | None:
    config = EngineArgs.from_cli_args(_args(*argv)).create_engine_config()
    return config.cache_config.kv_cache_memory_bytes


def test_kv_cache_memory_bytes_is_vllm_s_name_of_kv_cache_memory(capsys):
    assert _cache("--kv-cache-memory-bytes", "536870912") == 512 << 20
    assert _cache("--kv-cache-memory-bytes", "512M") == 512 << 20  # vLLM's binary suffix
    assert _cache("--kv-cache-memory-bytes", "1.5g") == 1_500_000_000  # its decimal one
    assert _cache("--kv-cache-memory", "512MiB") == 512 << 20
    assert EngineArgs(kv_cache_memory_bytes=1 << 26).create_engine_config().cache_config \
        .kv_cache_memory_bytes == 1 << 26  # LLM(kv_cache_memory_bytes=...) too  # fmt: skip
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes and --kv-cache-memory both"):
        _cache("--kv-cache-memory-bytes", "1G", "--kv-cache-memory", "1GiB")
    for bad in ("512MiB", "1.5G", "-1"):
        with pytest.raises(SystemExit):
            _args("--kv-cache-memory-bytes", bad)
        assert "--kv-cache-memory-bytes" in capsys.readouterr().err


# -- --tokens-only ------------------------------------------------------------------------


class _TokensEngine(_Engine):
    has_tokenizer = False

    def __init__(self) -> None:
        super().__init__()
        self.params = []
        self.aborted: list = []

    async def add_request(self, prompt, params, request_id, priority=0, executor=None, **kw):
        self.params.append(params)
        return _Stream(list(prompt))

    async def abort_requests(self, request_ids):
        self.aborted.append(request_ids)
        return len(request_ids or ())


def test_tokens_only_serves_the_tokens_routes_without_detokenizing():
    front = _front("--tokens-only")
    assert front.tokens_only and front.enable_scale_out  # the scale-out routes are served
    engine = _TokensEngine()
    app = _app(engine, tokens_only=True)
    body = b'{"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}}'
    status, payload, _ = _call(app, "/inference/v1/generate", "POST", body=body)
    assert status == 200 and json.loads(payload)["choices"][0]["token_ids"] == [111, 107]
    assert engine.params[0].detokenize is False  # vLLM's force_no_detokenize
    stop = b'{"token_ids": [5], "sampling_params": {"stop": ["x"]}}'
    status, payload, _ = _call(app, "/inference/v1/generate", "POST", body=stop)
    error = json.loads(payload)["error"]
    assert status == 400 and error["param"] == "sampling_params.stop"
    assert "--tokens-only" in error["message"] and "stop_token_ids" in error["message"]
    # vLLM's legacy abort path, as /inference/v1/abort_requests (behind --api-key here).
    for path in ("/abort_requests", "/inference/v1/abort_requests"):
        status, payload, _ = _call(app, path, "POST", body=b'{"request_ids": ["a"]}')
        assert status == 200 and json.loads(payload)["aborted"] == 1
    assert engine.aborted == [["a"], ["a"]]
    keyed = _app(_TokensEngine(), tokens_only=True, api_key="k")
    assert _call(keyed, "/abort_requests", "POST", body=b'{"request_ids": []}')[0] == 401
    assert _call(_app(_TokensEngine()), "/abort_requests", "POST", body=b"{}")[0] == 404


def test_tokens_only_refuses_what_needs_a_tokenizer():
    for argv in (["--reasoning-parser", "qwen3"], ["--enable-tokenizer-info-endpoint"],
                 ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]):  # fmt: skip
        with pytest.raises(ValueError, match=f"--tokens-only loads no tokenizer.*{argv[0]}"):
            _front("--tokens-only", *argv)
    engine_args = EngineArgs.from_cli_args(_args("--tokens-only"))
    tokens_only(engine_args)
    assert engine_args.create_engine_config().model_config.skip_tokenizer_init
    with pytest.raises(ValueError, match="--tokens-only loads no tokenizer: --tokenizer"):
        tokens_only(EngineArgs.from_cli_args(_args("--tokens-only", "--tokenizer", "t")))


# -- --ssl-ciphers ------------------------------------------------------------------------

CIPHER = "ECDHE-RSA-AES256-GCM-SHA384"


def test_ssl_ciphers_reach_uvicorn_s_tls_context(tmp_path):
    with pytest.raises(ValueError, match="--ssl-ciphers needs HTTPS"):
        _front("--ssl-ciphers", CIPHER)
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test's certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    tls = ("--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    with pytest.raises(ValueError, match="--ssl-ciphers 'NOPE' names no cipher suite"):
        _front(*tls, "--ssl-ciphers", "NOPE")
    config = launcher.uvicorn_config(object(), _front(*tls, "--ssl-ciphers", CIPHER))
    config.load()
    assert isinstance(config.ssl, ssl.SSLContext)
    tls12 = {c["name"] for c in config.ssl.get_ciphers() if c["protocol"] != "TLSv1.3"}
    assert tls12 == {CIPHER}
    default = launcher.uvicorn_config(object(), _front(*tls))
    default.load()
    assert len({c["name"] for c in default.ssl.get_ciphers()}) > 5


# -- --log-error-stack --------------------------------------------------------------------


def test_log_error_stack_logs_each_error_response_s_traceback(caplog):
    class _Refusing(_Engine):
        async def add_request(self, *a, **kw):
            raise ValueError("engine says no")

    body = json.dumps({"prompt": "hi"}).encode()
    logger = "vllm.entrypoints.openai.api_server"
    with caplog.at_level(logging.ERROR, logger):
        assert _call(_app(_Refusing()), "/v1/completions", "POST", body=body)[0] == 400
        assert not caplog.records
        app = _app(_Refusing(), log_error_stack=True)
        assert _call(app, "/v1/completions", "POST", body=body)[0] == 400
        assert _call(app, "/v1/completions", "POST", body=b"{nope")[0] == 400
    first, second = caplog.records
    assert first.exc_info[0] is ValueError and "400 on POST /v1/completions" in first.message
    assert "add_request" in caplog.text  # the stack trace itself
    assert second.exc_info is not None and "RequestValidationError" in second.message
    assert _front("--log-error-stack").log_error_stack
