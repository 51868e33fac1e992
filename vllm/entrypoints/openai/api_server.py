"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine process."""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import time
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm import __version__
from vllm.config import VllmConfig
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineDeadError
from vllm.v1.metrics.prometheus import PrometheusStatLogger

logger = logging.getLogger("vllm.entrypoints.openai.api_server")


def error_response(
    status: int,
    message: str,
    err_type: str,
    param: str | None = None,
    code: int | str | None = None,
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={
            "error": {
                "message": message,
                "type": err_type,
                "param": param,
                "code": code if code is not None else status,
            }
        },
    )


def bad_request(exc: ValueError) -> JSONResponse:
    """The one place a rejected request becomes its OpenAI-style 400."""
    param = code = None
    if isinstance(exc, VLLMValidationError):
        param, code = exc.param, exc.code
    return error_response(400, str(exc), "BadRequestError", param, code)


def validation_error_response(errors: list[dict]) -> JSONResponse:
    """A 400 for the first pydantic error, naming the top-level field it is in."""
    first = errors[0] if errors else {}
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, VLLMValidationError):  # raised inside a protocol.py validator
        return bad_request(cause)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid" or not loc:
        return error_response(400, "Invalid JSON in the request body.", "BadRequestError")
    msg = str(cause) if isinstance(cause, ValueError) else first.get("msg", "invalid")
    return error_response(400, f"{'.'.join(loc)}: {msg}", "BadRequestError", loc[0])


RECEIVED_KEY = "vllm.received"  # ASGI scope key: time.monotonic() at arrival


class ServerMiddleware:
    """Pure ASGI (BaseHTTPMiddleware would cost per request and break disconnect
    detection): stamps the arrival time into the scope and checks the API key of /v1."""

    def __init__(self, app, api_key: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[RECEIVED_KEY] = time.monotonic()
        if self.expected is not None and scope["path"].startswith("/v1"):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                response = error_response(
                    401, "Invalid API key.", "AuthenticationError", code="invalid_api_key"
                )
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(
    vllm_config: VllmConfig,
    args: argparse.Namespace,
    engine: AsyncLLM,
    stats: PrometheusStatLogger,
) -> FastAPI:
    """The FastAPI app over a started ``engine`` whose outputs feed ``stats``."""
    model_name = vllm_config.model_config.name
    chat_serving = OpenAIServingChat(engine, model_name, stats)
    chat_serving.tool_config = ToolCallingConfig.from_args(args)
    completion_serving = OpenAIServingCompletion(engine, model_name, stats)
    log_requests = not getattr(args, "disable_log_requests", False)

    app = FastAPI(title="vllm-continuum", version=__version__)
    app.add_middleware(ServerMiddleware, api_key=getattr(args, "api_key", None))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return validation_error_response(exc.errors())

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        # VLLMValidationError (a ValueError) from SamplingParams, the processor or the
        # serving layer; a bare ValueError is an engine-side rejection of the request.
        return bad_request(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        # E.g. a body json.loads cannot parse (too deep for its recursion limit, an integer
        # with too many digits), 404 and 405: the OpenAI error shape for these too.
        phrase = HTTPStatus(exc.status_code).phrase.replace(" ", "")
        err_type = "BadRequestError" if exc.status_code == 400 else f"{phrase}Error"
        return error_response(exc.status_code, str(exc.detail), err_type)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError):
        return error_response(500, f"Engine is dead: {exc}", "InternalServerError")

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        # Always the classic text format: an OpenMetrics scrape would escape the colons.
        return Response(generate_latest(stats.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=model_name, max_model_len=vllm_config.scheduler_config.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest, raw: Request):
        if log_requests:
            _log_request("chat", request, f"messages={len(request.messages)}")
        return await chat_serving.create_chat_completion(
            request, raw.scope.get(RECEIVED_KEY), raw.receive
        )

    @app.post("/v1/completions")
    async def completion(request: CompletionRequest, raw: Request):
        if log_requests:
            _log_request("completion", request, "")
        return await completion_serving.create_completion(
            request, raw.scope.get(RECEIVED_KEY), raw.receive
        )

    return app


def _log_request(kind: str, request, detail: str) -> None:
    logger.info(
        "%s request: job_id=%s is_last_step=%s max_tokens=%s stream=%s %s",
        kind,
        request.job_id,
        request.is_last_step,
        request.max_tokens,
        request.stream,
        detail,
    )


async def run_server(
    vllm_config: VllmConfig, args: argparse.Namespace, sock, engine_factory=None
) -> None:
    """Start the engine process, then serve HTTP on ``sock`` until SIGINT/SIGTERM.

    ``EngineStartupError`` if the engine cannot start; the engine is shut down on exit.
    """
    import uvicorn

    disable_created_metrics()  # no *_created series, as in vLLM
    stats = PrometheusStatLogger(vllm_config.model_config.name)
    engine = AsyncLLM(vllm_config, stat_loggers=[stats], engine_factory=engine_factory)
    try:
        info = await engine.start()
        logger.info(
            "Engine core ready: %d KV blocks of %d tokens (pid %d)",
            info["num_gpu_blocks"],
            vllm_config.cache_config.block_size,
            info["pid"],
        )
        app = build_app(vllm_config, args, engine, stats)
        config = uvicorn.Config(
            app,
            log_level=getattr(args, "uvicorn_log_level", "info"),
            timeout_graceful_shutdown=5,
            access_log=not getattr(args, "disable_log_requests", False),
        )
        host, port = sock.getsockname()[:2]
        logger.info("Starting vLLM API server on http://%s:%d", host, port)
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        engine.shutdown()


def dump_config(vllm_config: VllmConfig) -> str:
    from dataclasses import asdict

    return json.dumps(asdict(vllm_config), default=str)
