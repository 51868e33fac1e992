"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine process."""

from __future__ import annotations

import argparse
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest

from vllm import __version__
from vllm.config import VllmConfig
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    RequestError,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
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


def build_app(vllm_config: VllmConfig, args: argparse.Namespace) -> FastAPI:
    disable_created_metrics()  # no *_created series, as in vLLM
    model_name = vllm_config.model_config.name
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stats = PrometheusStatLogger(model_name)
        engine = AsyncLLM(vllm_config, stat_loggers=[stats])
        try:
            info = await engine.start()
        except BaseException:
            engine.shutdown()
            raise
        logger.info(
            "Engine core ready: %d KV blocks of %d tokens (pid %d)",
            info["num_gpu_blocks"],
            vllm_config.cache_config.block_size,
            info["pid"],
        )
        state.update(
            engine=engine,
            stats=stats,
            chat=OpenAIServingChat(engine, model_name),
            completion=OpenAIServingCompletion(engine, model_name),
        )
        yield
        engine.shutdown()

    app = FastAPI(title="vllm-continuum", version=__version__, lifespan=lifespan)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if args.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {args.api_key}":
                return error_response(
                    401, "Invalid API key.", "AuthenticationError", code="invalid_api_key"
                )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
        if first.get("type") == "json_invalid" or loc == []:
            return error_response(400, "Invalid JSON in the request body.", "BadRequestError")
        param = loc[0] if loc else None
        return error_response(
            400,
            f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}",
            "BadRequestError",
            param,
        )

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return error_response(exc.status, str(exc), "BadRequestError", exc.param, exc.code)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError):
        return error_response(400, str(exc), "BadRequestError")

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError):
        return error_response(500, f"Engine is dead: {exc}", "InternalServerError")

    @app.get("/health")
    async def health():
        alive = "engine" in state and state["engine"].is_alive
        return Response(status_code=200 if alive else 503)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics():
        # Always the classic text format: an OpenMetrics scrape would escape the colons.
        return Response(generate_latest(state["stats"].registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=model_name, max_model_len=vllm_config.scheduler_config.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest):
        if not args.disable_log_requests:
            logger.info(
                "chat request: job_id=%s is_last_step=%s messages=%d",
                request.job_id,
                request.is_last_step,
                len(request.messages),
            )
        return await state["chat"].create_chat_completion(request)

    @app.post("/v1/completions")
    async def completion(request: CompletionRequest):
        return await state["completion"].create_completion(request)

    return app


def dump_config(vllm_config: VllmConfig) -> str:
    from dataclasses import asdict

    return json.dumps(asdict(vllm_config), default=str)
