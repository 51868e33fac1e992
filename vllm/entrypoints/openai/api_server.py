"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of the engine process."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import json
import logging
import socket
import time
import uuid
from collections.abc import Sequence
from http import HTTPStatus
from typing import Annotated, Literal

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from vllm import __version__, envs
from vllm.config import VllmConfig
from vllm.entrypoints.anthropic import protocol as anthropic_models
from vllm.entrypoints.anthropic.serving import (
    AnthropicServingMessages,
    add_messages_routes,
    anthropic_error,
    as_anthropic,
    is_messages_path,
)
from vllm.entrypoints.launcher import (
    ServerShuttingDownError,
    ServerState,
    serve_http,
    stop_on_signal_while_starting,
)
from vllm.entrypoints.openai import openapi
from vllm.entrypoints.openai.cli_args import FrontendArgs, resolve_middleware
from vllm.entrypoints.openai.conversations import add_conversation_routes
from vllm.entrypoints.openai.job_identity import read_headers
from vllm.entrypoints.openai.mcp_tools import MCPToolServer  # imports mcp only when used
from vllm.entrypoints.openai.parser_plugins import load_parser_plugins
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
    loggable,
)
from vllm.entrypoints.openai.protocol_generate import (
    ABORT_PATH,
    CHAT_DERENDER_PATH,
    COMPLETION_DERENDER_PATH,
    GENERATE_PATH,
    SCALE_OUT_PATHS,
    AbortAllRequest,
    AbortRequestsRequest,
    DerenderChatBody,
    DerenderChatStreamRequest,
    DerenderCompletionBody,
    DerenderCompletionStreamRequest,
    GenerateRequest,
)
from vllm.entrypoints.openai.responses_store import ResponseStore, SharedResponseStore
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_chat_batch import add_batch_chat_route
from vllm.entrypoints.openai.serving_classify import (
    POOLING_PATHS,
    OpenAIServingClassification,
    add_pooling_routes,
)
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses, add_responses_routes
from vllm.entrypoints.openai.serving_score import (
    RERANK_PATHS,
    SCORE_PATHS,
    OpenAIServingScore,
    RerankRequest,
    ScoreRequest,
)
from vllm.entrypoints.openai.serving_tokenize import (
    DetokenizeRequest,
    OpenAIServingTokenization,
    TokenizeRequest,
)
from vllm.entrypoints.openai.serving_tokens import OpenAIServingTokens
from vllm.entrypoints.openai.tool_calling import ToolCallingConfig, special_tokens_of
from vllm.entrypoints.openai.weight_transfer_routes import add_weight_transfer_routes
from vllm.entrypoints.utils import INSTANCE_HEADER
from vllm.exceptions import GenerationError, GracefulHTTPError, VLLMValidationError
from vllm.tracing import extract_trace_headers, trace_headers_scope
from vllm.utils.gc_utils import freeze_gc_heap, maybe_attach_gc_debug_callback
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import EngineDeadError, EngineLink, EngineStartupError
from vllm.v1.engine.dp_client import DPLink
from vllm.v1.engine.dp_rank import HEADER as DP_RANK_HEADER
from vllm.v1.engine.dp_rank import parse_rank, rank_scope
from vllm.v1.metrics.loggers import LoggingStatLogger
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


NOT_FOUND_CODES = ("model_not_found", "not_found")


def bad_request(exc: ValueError) -> JSONResponse:
    """The one place a rejected request becomes its OpenAI-style 400 (404 for a model or
    an adapter the server does not have, as vLLM answers)."""
    param = code = None
    if isinstance(exc, VLLMValidationError):
        param, code = exc.param, exc.code
    if code in NOT_FOUND_CODES:
        return error_response(404, str(exc), "NotFoundError", param, code)
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
# The anthropic client sends it with every request: /v1/models answers in its shape.
ANTHROPIC_VERSION = "anthropic-version"


def instance_id(sock) -> str:
    """``host:port`` of the listening socket; the host name when bound to every address;
    ``unix:<path>`` for a Unix socket (--uds)."""
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"The request body exceeds {limit} bytes (the server's --max-request-body-size)."
        )


def _limited(receive, limit: int):
    """``receive`` that raises ``BodyTooLarge`` once the body passes ``limit`` bytes (for a
    body without Content-Length, or longer than it said)."""
    seen = 0

    async def receive_limited() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return receive_limited


class ServerMiddleware:
    """Pure ASGI (BaseHTTPMiddleware would cost per request and break disconnect
    detection): stamps the arrival time into the scope, checks the API key of /v1, bounds
    the body, refuses new /v1 requests while draining and counts those in flight; names
    the server (``INSTANCE_HEADER``) on each /v1 response when ``instance`` is given, and
    (``--enable-request-id-headers``) every response with its ``X-Request-Id``. A path
    is judged without the ``--root-path`` prefix a proxy may have left on it, as the
    routes match it: ``/llm/v1/models`` is ``/v1/models`` behind ``--root-path /llm``."""

    def __init__(
        self, app, args: FrontendArgs, state: ServerState, instance: str | None = None
    ) -> None:
        self.app = app
        self.expected = f"Bearer {args.api_key}".encode() if args.api_key else None
        self.key = args.api_key.encode() if args.api_key else None
        self.limit = args.max_request_body_size
        self.state = state
        self.instance = (INSTANCE_HEADER.encode(), instance.encode()) if instance else None
        self.request_ids = args.enable_request_id_headers
        self.root_path = args.root_path
        self.track_load = getattr(args, "enable_server_load_tracking", False)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.root_path:  # as uvicorn's --root-path would set it; the routes strip it
            scope["root_path"] = self.root_path
        if self.request_ids:
            send = _with_request_id(send, dict(scope["headers"]))
        path = route_path(scope)
        if not (path.startswith("/v1") or path in GUARDED):  # the API's routes
            return await self.app(scope, receive, send)
        scope[RECEIVED_KEY] = time.monotonic()
        if self.instance is not None:
            send = self._naming(send)
        headers = dict(scope["headers"])
        refusal = self._refusal(headers)
        if refusal is not None:
            if is_messages_path(path):
                refusal = as_anthropic(refusal)
            return await refusal(scope, receive, send)
        rank = None
        if DP_RANK_HEADER in headers:  # vLLM's: the data-parallel rank to run on
            try:
                rank = parse_rank(headers[DP_RANK_HEADER])
            except ValueError as e:
                refusal = error_response(400, str(e), "BadRequestError")
                return await refusal(scope, receive, send)
        # A W3C trace context: the request's span joins that trace (vllm/tracing.py).
        trace = None
        if b"traceparent" in headers:
            trace = extract_trace_headers({k.decode("latin-1"): v.decode("latin-1")
                                           for k, v in headers.items()})  # fmt: skip
        load = self.track_load and is_load_path(path)
        self.state.active += 1
        self.state.load += load
        try:
            with trace_headers_scope(trace), rank_scope(rank):
                await self.app(scope, _limited(receive, self.limit), send)
        finally:
            self.state.active -= 1
            self.state.load -= load

    def _naming(self, send):
        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.instance]}
            await send(message)

        return send_named

    def _refusal(self, headers: dict[bytes, bytes]) -> Response | None:
        if self.expected is not None:
            # OpenAI clients send the key as a bearer token, Anthropic's as x-api-key.
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            if not (bearer or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                return error_response(
                    401, "Invalid API key.", "AuthenticationError", code="invalid_api_key"
                )
        if self.state.draining:
            return error_response(503, "The server is shutting down.", "ServiceUnavailableError")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            return error_response(413, str(BodyTooLarge(self.limit).detail), "RequestTooLargeError")
        return None


INVOCATIONS = "/invocations"  # SageMaker's route to the API: guarded as /v1 is
# The API's routes outside /v1 that run the model: behind --api-key and the drain as /v1
# is (vLLM guards /v1 alone).
PROFILE_PATHS = ("/start_profile", "/stop_profile")  # with --profiler-config
RESET_PREFIX_CACHE = "/reset_prefix_cache"  # with VLLM_SERVER_DEV_MODE=1
# VLLM_SERVER_DEV_MODE=1's routes that change what the engine runs or holds.
LEGACY_ABORT_PATH = "/abort_requests"  # dev mode's, or --tokens-only's (vLLM's legacy path)
# vLLM's RL weight sync (dev mode): a trainer pushes new weights into the running engine.
WEIGHT_TRANSFER_PATHS = ("/init_weight_transfer_engine", "/shutdown_weight_transfer_engine",
                         "/start_weight_update", "/update_weights", "/finish_weight_update",
                         "/update_weight_version", "/weight_info", "/weight_checker",
                         "/get_world_size")  # fmt: skip
DEV_PATHS = (RESET_PREFIX_CACHE, "/sleep", "/wake_up", "/is_sleeping", "/pause", "/resume",
             "/is_paused", LEGACY_ABORT_PATH, "/server_info", *WEIGHT_TRANSFER_PATHS)  # fmt: skip
GUARDED = frozenset({INVOCATIONS, *SCORE_PATHS, *RERANK_PATHS, *PROFILE_PATHS, *DEV_PATHS,
                     *POOLING_PATHS, GENERATE_PATH, ABORT_PATH})  # fmt: skip


# The routes that run the model (--enable-server-load-tracking counts them, as vLLM's).
LOAD_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                        "/v1/messages", INVOCATIONS, GENERATE_PATH, *POOLING_PATHS,
                        *SCORE_PATHS, *RERANK_PATHS, "/v1/chat/completions/batch"})  # fmt: skip


def is_load_path(path: str) -> bool:
    """A model route: one of ``LOAD_PATHS``, or the Responses API's (its create, retrieve
    and cancel, as vLLM counts them)."""
    return path in LOAD_PATHS or path == "/v1/responses" or path.startswith("/v1/responses/")


def route_path(scope: dict) -> str:
    """The path the routes match: without the ``root_path`` prefix, when it carries one."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


REQUEST_ID_HEADER = b"x-request-id"


def _with_request_id(send, headers: dict[bytes, bytes]):
    """``send`` adding ``X-Request-Id`` to the response: the request's (as vLLM), or new."""
    header = (REQUEST_ID_HEADER, headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex.encode())

    async def send_with_id(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), header]}
        await send(message)

    return send_with_id


def health_status(engine: AsyncLLM, args: FrontendArgs, state: ServerState) -> str | None:
    """Why the server is unhealthy (503), or None."""
    if not engine.is_alive:
        return "engine dead"
    if state.draining:
        return "shutting down"
    stalled = engine.stalled_for()
    if stalled > args.engine_stall_timeout:
        pending = engine.num_unfinished_requests
        return f"engine stalled: no progress for {stalled:.0f} s with {pending} requests pending"
    return None


def build_app(
    vllm_config: VllmConfig,
    args: FrontendArgs,
    engine: AsyncLLM,
    stats: PrometheusStatLogger,
    state: ServerState | None = None,
    instance: str | None = None,
    response_store: ResponseStore | SharedResponseStore | None = None,
    tool_server: MCPToolServer | None = None,
) -> FastAPI:
    """The FastAPI app over a started ``engine`` whose outputs feed ``stats``; ``instance``
    (``instance_id``) names the server on each /v1 response; ``response_store``: where
    ``/v1/responses`` keeps stored responses (None: a new in-memory one); ``tool_server``:
    the connected --tool-server MCP servers the Responses API's mcp tools may use."""
    state = state or ServerState()
    model_name = vllm_config.model_config.name
    lora = vllm_config.lora_config
    models = OpenAIServingModels(
        model_name,
        vllm_config.scheduler_config.max_model_len,
        args.lora_modules or (),
        lora.enable_lora,
        lora.max_lora_rank,
        vllm_config.model_config.served_names,
    )
    chat_serving = OpenAIServingChat(engine, model_name, stats, args, state, models)
    # An engine client without a tokenizer (--skip-tokenizer-init, a test's fake) has no
    # special tokens: the tool-call trigger is then matched as text.
    special = special_tokens_of(getattr(engine, "tokenizer", None))
    chat_serving.tool_config = dataclasses.replace(
        ToolCallingConfig.from_args(args), special_tokens=special
    )
    completion_serving = OpenAIServingCompletion(engine, model_name, stats, args, state, models)
    log_requests = not args.disable_log_requests

    # --disable-fastapi-docs: no schema, no docs pages (None turns each route off).
    off = ("openapi_url", "docs_url", "redoc_url")
    docs = dict.fromkeys(off) if args.disable_fastapi_docs else {}
    app = FastAPI(title="vllm-continuum", version=__version__, **docs)
    app.add_middleware(ServerMiddleware, args=args, state=state, instance=instance)
    # Outermost (added last): a browser's preflight is answered before the API key is
    # asked for, and every response, a refusal too, carries the CORS headers it needs.
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(args.allowed_origins),
        allow_methods=list(args.allowed_methods),
        allow_headers=list(args.allowed_headers),
        allow_credentials=args.allow_credentials,
    )
    _add_user_middleware(app, getattr(args, "middleware", None) or ())
    _add_error_handlers(app, args.log_error_stack or envs.VLLM_SERVER_DEV_MODE)

    _add_info_routes(app, vllm_config, args, engine, stats, state, models)
    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        _add_lora_routes(app, models)

    @app.post("/v1/chat/completions", responses=openapi.GENERATE_RESPONSES)
    async def chat(request: ChatCompletionRequest, raw: Request):
        read_headers(request, raw.headers, args.max_job_id_length)
        if log_requests:
            _log_request("chat", request, f"messages={len(request.messages)}")
        return await chat_serving.create_chat_completion(
            request, raw.scope.get(RECEIVED_KEY), raw.receive
        )

    add_batch_chat_route(app, chat_serving, RECEIVED_KEY, log_requests)  # vLLM's batch chat

    @app.post("/v1/chat/completions/render", responses=openapi.RENDER_RESPONSES)
    async def chat_render(request: ChatCompletionRequest, raw: Request):
        read_headers(request, raw.headers, args.max_job_id_length)
        return await chat_serving.render_chat(request)

    tokens_serving = OpenAIServingTokens(engine, model_name, stats, args, state, models)
    tokens_serving.chat, tokens_serving.completions = chat_serving, completion_serving
    _add_scale_out_routes(app, args, tokens_serving, completion_serving)

    @app.post("/v1/completions", responses=openapi.GENERATE_RESPONSES)
    async def completion(request: CompletionRequest, raw: Request):
        read_headers(request, raw.headers, args.max_job_id_length)
        if log_requests:
            _log_request("completion", request, "")
        return await completion_serving.create_completion(
            request, raw.scope.get(RECEIVED_KEY), raw.receive
        )

    embedding_serving = OpenAIServingEmbedding(engine, model_name, stats, args, state, models)

    @app.post("/v1/embeddings", responses=openapi.EMBEDDING_RESPONSES)
    async def embeddings(request: EmbeddingRequest, raw: Request):
        if log_requests:
            logger.info("embedding request: inputs=%d", len(request.prompts()))
        return await embedding_serving.create_embedding(
            request, raw.scope.get(RECEIVED_KEY), raw.receive
        )

    # vLLM's /classify (a classifier) and /pooling (the model's own task).
    classify_serving = OpenAIServingClassification(engine, model_name, stats, args, state, models)
    add_pooling_routes(app, classify_serving, RECEIVED_KEY, log_requests)

    scoring = OpenAIServingScore(engine, model_name, stats, args, state, models)

    async def score(request: ScoreRequest, raw: Request):
        return await scoring.create_score(request, raw.scope.get(RECEIVED_KEY), raw.receive)

    async def rerank(request: RerankRequest, raw: Request):
        return await scoring.create_rerank(request, raw.scope.get(RECEIVED_KEY), raw.receive)

    for path in SCORE_PATHS:  # vLLM's: /score, and /v1/score
        app.post(path, responses=openapi.SCORE_RESPONSES)(score)
    for path in RERANK_PATHS:  # /rerank (Jina's), /v1/rerank, /v2/rerank (Cohere's)
        app.post(path, responses=openapi.RERANK_RESPONSES)(rerank)

    scores = [(side, ScoreRequest, score) for side in ("text_1", "data_1", "queries")]
    routes = (("messages", ChatCompletionRequest, chat), ("prompt", CompletionRequest, completion),
              ("input", EmbeddingRequest, embeddings), ("query", RerankRequest, rerank),
              *scores)  # fmt: skip

    @app.post(
        INVOCATIONS, responses=openapi.GENERATE_RESPONSES, openapi_extra=openapi.ANY_OBJECT_BODY
    )
    async def invocations(raw: Request):
        """SageMaker's route, as vLLM serves it: the body's fields name the API (messages:
        chat, prompt: completions, input: embeddings, query: rerank, text_1 / data_1 /
        queries: score). Behind --api-key, unlike vLLM's."""
        try:
            body = await raw.json()
        except ValueError:
            raise RequestValidationError([{"type": "json_invalid"}]) from None
        for field, model, route in routes:
            if isinstance(body, dict) and field in body:
                try:
                    request = model.model_validate(body)
                except ValidationError as e:  # a 400 naming the field, as on its route
                    raise RequestValidationError(e.errors()) from None
                return await route(request, raw)
        raise VLLMValidationError(
            "the body must be a chat (messages), completion (prompt), embedding (input), "
            "rerank (query) or score (text_1) request",
            None,
        )

    profiler = getattr(vllm_config, "profiler_config", None)  # (a test's config may lack it)
    if profiler is not None and profiler.enabled:  # as vLLM: the routes exist with a profiler

        @app.post(PROFILE_PATHS[0], responses=openapi.PROFILE_RESPONSES)
        async def start_profile():
            """The engine core starts recording its steps (torch.profiler)."""
            await engine.start_profile()
            return Response(status_code=200)

        @app.post(PROFILE_PATHS[1], responses=openapi.PROFILE_RESPONSES)
        async def stop_profile():
            """The engine core stops recording and writes the trace."""
            await engine.stop_profile()
            return Response(status_code=200)

    if envs.VLLM_SERVER_DEV_MODE:  # vLLM's development route

        @app.post(RESET_PREFIX_CACHE, responses=openapi.RESET_RESPONSES)
        async def reset_prefix_cache():
            """Empty the prefix cache: {"success": false} while blocks are in use."""
            logger.info("Resetting the prefix cache")
            return {"success": await engine.reset_prefix_cache()}

        @app.post("/sleep", responses=openapi.SLEEP_RESPONSES)
        async def sleep(level: Annotated[int, Query(ge=0, le=2)] = 1):
            """vLLM's sleep mode (--enable-sleep-mode): running requests are aborted; those
            sent while asleep wait for /wake_up. 400 without the flag."""
            await engine.sleep(level)
            return {"status": "sleeping", "level": level}

        @app.post("/wake_up", responses=openapi.SLEEP_RESPONSES)
        async def wake_up(tags: Annotated[list[str] | None, Query()] = None):
            """Bring back ``tags`` (weights, kv_cache; none: all); scheduling resumes once
            the engine is fully awake."""
            awake = await engine.wake_up(tags or None)
            return {"status": "awake" if awake else "sleeping", "tags": tags or None}

        @app.get("/is_sleeping", responses=openapi.SLEEP_RESPONSES)
        async def is_sleeping():
            return {"is_sleeping": await engine.is_sleeping()}

        pause_responses = {**openapi.SLEEP_RESPONSES, 200: {"description": "Paused or not."}}

        @app.post("/pause", responses=pause_responses)
        async def pause(mode: str = "abort", clear_cache: bool = True):
            """vLLM's pause of generation: nothing new is scheduled until /resume (requests
            sent meanwhile wait). mode abort (default) ends the requests in flight, wait
            answers once they have finished, keep freezes them; clear_cache (not for keep)
            then empties the prefix cache. Another mode is a 400."""
            await engine.pause_generation(mode, clear_cache)
            return {"status": "paused"}

        @app.post("/resume", responses=pause_responses)
        async def resume():
            await engine.resume_generation()
            return {"status": "resumed"}

        @app.get("/is_paused", responses=pause_responses)
        async def is_paused():
            return {"is_paused": await engine.is_paused()}

        @app.get("/server_info", responses=openapi.SERVER_INFO_RESPONSES)
        async def server_info(
            config_format: Annotated[Literal["text", "json"], Query()] = "text",
        ):
            """vLLM's: the engine's configuration (as text, or as JSON), this engine's
            environment variables as read (none whose name holds KEY, TOKEN or SECRET),
            and the system's (Python, torch, CPU, devices)."""
            if config_format == "text":
                config = str(vllm_config)
            else:  # dtypes and the like as their text
                config = json.loads(json.dumps(dataclasses.asdict(vllm_config), default=str))
            return {
                "vllm_config": config,
                "vllm_env": server_env(),
                "system_env": await asyncio.to_thread(system_env),
            }

        @app.post("/abort_requests", responses=openapi.ABORT_RESPONSES)
        async def abort_all(request: AbortAllRequest | None = None):
            """vLLM's RL route: stop the requests whose responses' ids are listed, or, with
            none, every request in flight (each ends with finish_reason abort)."""
            ids = None if request is None else request.request_ids
            return await tokens_serving.abort(ids or None)

        add_weight_transfer_routes(app, vllm_config, engine, stats)

    tokenization = OpenAIServingTokenization(
        chat_serving, vllm_config.scheduler_config.max_model_len
    )

    @app.post("/tokenize", responses=openapi.TOKENIZE_RESPONSES)
    async def tokenize(request: TokenizeRequest):
        return await tokenization.tokenize(request)

    @app.post("/detokenize", responses=openapi.DETOKENIZE_RESPONSES)
    async def detokenize(request: DetokenizeRequest):
        return await tokenization.detokenize(request)

    if getattr(args, "enable_tokenizer_info_endpoint", False):  # opt-in, as vLLM's

        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return tokenization.tokenizer_info()

    responses_serving = OpenAIServingResponses(chat_serving, response_store)
    responses_serving.tool_server = tool_server
    add_responses_routes(app, responses_serving, RECEIVED_KEY)
    add_conversation_routes(app, responses_serving.conversations)  # shared as the store is
    add_messages_routes(app, AnthropicServingMessages(chat_serving, tool_server), RECEIVED_KEY)
    max_logprobs = getattr(vllm_config.model_config, "max_logprobs", 20)
    openapi.document_api(app, args, max_logprobs)
    return app


def _add_user_middleware(app: FastAPI, paths: Sequence[str]) -> None:
    """--middleware (vLLM's): a class is added with ``app.add_middleware``, an async
    function ``(request, call_next)`` with ``@app.middleware("http")``. Added after the
    server's own, so outside them (the last given outermost), as vLLM adds them."""
    for path in paths:
        middleware = resolve_middleware(path)
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)


def _add_info_routes(app: FastAPI, vllm_config, args, engine, stats, state, models) -> None:
    """/health (and SageMaker's /ping), /version, /metrics, /v1/models and the router's
    /get_load."""

    @app.get("/health", response_class=PlainTextResponse, responses=openapi.HEALTH_RESPONSES)
    async def health():
        reason = health_status(engine, args, state)
        return PlainTextResponse(reason or "", status_code=200 if reason is None else 503)

    # SageMaker's health check (vLLM serves it too): /health's answer, GET or POST.
    app.get("/ping", response_class=PlainTextResponse, responses=openapi.HEALTH_RESPONSES)(health)
    app.post("/ping", response_class=PlainTextResponse, responses=openapi.HEALTH_RESPONSES)(health)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS_RESPONSES)
    async def metrics():
        if not engine.is_alive:  # kept alive after the engine died: no frozen gauges
            stats.mark_engine_dead()
        return Response(stats.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def server_load():
        # vLLM's: this API server's model requests in flight (--enable-server-load-tracking;
        # 0 without it). With --api-server-count N, each process counts its own.
        return {"server_load": state.load}

    @app.get("/get_load")
    async def get_load():
        # vllm-router's power_of_two polls it and reads the integer "load" (its
        # get_worker_load_static): the requests this engine holds, running or waiting.
        return {"load": engine.engine_load}

    @app.get("/v1/models", responses=openapi.ERROR_RESPONSES)
    async def list_models(raw: Request):
        cards = models.model_cards()
        if ANTHROPIC_VERSION in raw.headers:  # the anthropic client's list
            return anthropic_models.model_list(cards)
        return ModelList(data=cards).model_dump()

    @app.get("/v1/models/{model_id:path}", responses=openapi.MODEL_RESPONSES)
    async def retrieve_model(model_id: str, raw: Request):
        anthropic = ANTHROPIC_VERSION in raw.headers
        card = next((c for c in models.model_cards() if c.id == model_id), None)
        if card is None:
            message = f"The model `{model_id}` does not exist."
            if anthropic:
                return anthropic_error(404, message)
            return error_response(404, message, "NotFoundError", "model", "model_not_found")
        return anthropic_models.model_info(card) if anthropic else card.model_dump()


def _add_scale_out_routes(
    app: FastAPI,
    args: FrontendArgs,
    tokens: OpenAIServingTokens,
    completions: OpenAIServingCompletion,
) -> None:
    """vLLM's scale-out routes (--enable-scale-out; without it each answers 403, as
    vLLM's): tokens in, tokens out, its aborts, and the /render routes of completions
    (here; chat's is always served), Messages and Responses (added with their APIs)."""
    if not args.enable_scale_out:

        async def disabled():
            return error_response(
                403,
                "Scale-out endpoints are disabled. Restart vllm serve with "
                "--enable-scale-out to enable them.",
                "PermissionDeniedError",
            )

        for path in SCALE_OUT_PATHS:
            app.post(path, include_in_schema=False)(disabled)
        return

    @app.post(GENERATE_PATH, responses=openapi.GENERATE_TOKENS_RESPONSES)
    async def generate(request: GenerateRequest, raw: Request):
        read_headers(request, raw.headers, args.max_job_id_length)
        return await tokens.create_generate(request, raw.scope.get(RECEIVED_KEY), raw.receive)

    @app.post(ABORT_PATH, responses=openapi.ABORT_RESPONSES)
    async def abort_requests(request: AbortRequestsRequest):
        """Stop the requests whose responses' ``id`` / ``request_id`` are listed; they end
        with finish_reason abort. Unknown or finished ids are skipped."""
        return await tokens.abort(request.request_ids)

    if args.tokens_only and not envs.VLLM_SERVER_DEV_MODE:  # dev mode has its own
        # vLLM's legacy path of --tokens-only deployments (behind --api-key here).
        app.post(LEGACY_ABORT_PATH, responses=openapi.ABORT_RESPONSES)(abort_requests)

    @app.post("/v1/completions/render", responses=openapi.RENDER_LIST_RESPONSES)
    async def completion_render(request: CompletionRequest, raw: Request):
        read_headers(request, raw.headers, args.max_job_id_length)
        return await completions.render_completion(request)

    @app.post(CHAT_DERENDER_PATH, responses=openapi.DERENDER_RESPONSES)
    async def chat_derender(request: DerenderChatBody):
        """A tokens-mode generate response read back as the chat route reads its output
        (tool calls, reasoning), per the chat request /render was given; with stream
        true, one generate chunk a call, the client carrying the stream_state."""
        if isinstance(request, DerenderChatStreamRequest):
            return await tokens.derender_chat_stream(request)
        return await tokens.derender_chat(request)

    @app.post(COMPLETION_DERENDER_PATH, responses=openapi.DERENDER_RESPONSES)
    async def completion_derender(request: DerenderCompletionBody):
        """Generate responses (one per prompt) read back as the completions route's; with
        stream true, one generate chunk a call."""
        if isinstance(request, DerenderCompletionStreamRequest):
            return await tokens.derender_completion_stream(request)
        return await tokens.derender_completion(request)


SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def server_env() -> dict[str, object]:
    """/server_info's ``vllm_env``: each environment variable this engine reads
    (``vllm/envs.py``), as read (defaults included), none that may hold a secret."""
    out: dict[str, object] = {}
    for name in envs.environment_variables:
        if any(word in name for word in SECRET_WORDS):
            continue
        value = getattr(envs, name)
        if value is not None:
            out[name] = value if isinstance(value, bool | int | float) else str(value)
    return out


def system_env() -> dict[str, object]:
    """/server_info's ``system_env``: what the server runs on (vLLM's collect_env, in
    brief)."""
    import os
    import platform
    import sys

    import torch

    # No device is touched: a CUDA context here would take memory from the engine's.
    return {
        "os": platform.platform(),
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda_version": torch.version.cuda,
        "cuda_device_count": torch.cuda.device_count(),
        "vllm_version": __version__,
    }


def _add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """vLLM's runtime adapter routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING): plain-text
    success messages, OpenAI-style errors (400; 404 for an adapter not loaded)."""

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(request: LoadLoRAAdapterRequest):
        return models.load_lora_adapter(request.lora_name, request.lora_path)

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest):
        return models.unload_lora_adapter(request.lora_name)


def _add_error_handlers(app: FastAPI, log_stack: bool = False) -> None:
    """Every error in the OpenAI shape ``{"error": {message, type, param, code}}``; on
    /v1/messages, in Anthropic's (``as_anthropic``). ``log_stack`` (--log-error-stack):
    each one's exception is logged with its stack trace (an unexpected one's uvicorn
    logs already, as starlette re-raises it)."""

    def handler(kind: type[Exception]):
        def register(build):
            async def handle(request: Request, exc: Exception):
                response = build(exc)
                if log_stack and kind is not Exception:
                    _log_error_stack(request, response.status_code, exc)
                return as_anthropic(response) if is_messages_path(request.url.path) else response

            app.add_exception_handler(kind, handle)
            return build

        return register

    @handler(RequestValidationError)
    def on_validation_error(exc: RequestValidationError):
        return validation_error_response(exc.errors())

    @handler(ValueError)
    def on_value_error(exc: ValueError):
        # VLLMValidationError (a ValueError) from SamplingParams, the processor or the
        # serving layer; a bare ValueError is an engine-side rejection of the request.
        return bad_request(exc)

    @handler(StarletteHTTPException)
    def on_http_error(exc: StarletteHTTPException):
        # E.g. a body json.loads cannot parse (too deep for its recursion limit, an integer
        # with too many digits), a body over the limit, 404 and 405.
        err_type = _HTTP_ERROR_TYPES.get(exc.status_code)
        if err_type is None:
            err_type = HTTPStatus(exc.status_code).phrase.replace(" ", "") + "Error"
        return error_response(exc.status_code, str(exc.detail), err_type)

    @handler(GenerationError)
    def on_generation_error(exc: GenerationError):
        # The engine logged the traceback; this request alone failed.
        return error_response(exc.status, str(exc), exc.err_type)

    @handler(GracefulHTTPError)
    def on_graceful(exc: GracefulHTTPError):
        # A queue limit (--max-num-queued-reqs/-tokens): 503, nothing was queued.
        return error_response(exc.status, str(exc), exc.err_type)

    @handler(EngineDeadError)
    def on_engine_dead(exc: EngineDeadError):
        return error_response(500, f"Engine is dead: {exc}", "InternalServerError")

    @handler(ServerShuttingDownError)
    def on_shutting_down(exc: ServerShuttingDownError):
        return error_response(exc.status, str(exc), exc.err_type)

    @handler(Exception)
    def on_unexpected(exc: Exception):
        # A bug: a JSON 500 (never starlette's plain text); starlette re-raises the
        # exception after this response, so uvicorn logs its traceback. Its message may
        # hold internals: the client gets the type only.
        return error_response(
            500, f"Internal server error ({type(exc).__name__}).", "InternalServerError"
        )


_HTTP_ERROR_TYPES = {400: "BadRequestError", 413: "RequestTooLargeError"}


def _log_error_stack(request: Request, status: int, exc: Exception) -> None:
    request_id = request.headers.get("x-request-id")
    logger.error(
        "%d on %s %s (request id %s): %s",
        status,
        request.method,
        request.url.path,
        request_id,
        type(exc).__name__,
        exc_info=exc,
    )


def _log_request(kind: str, request, detail: str) -> None:
    logger.info(
        "%s request: job_id=%s is_last_step=%s max_tokens=%s stream=%s %s",
        kind,
        loggable(request.job_id),
        request.is_last_step,
        request.max_tokens,
        request.stream,
        detail,
    )


async def run_server(
    vllm_config: VllmConfig,
    args: FrontendArgs,
    sock,
    engine_factory=None,
    link: EngineLink | DPLink | None = None,
    response_store: str | None = None,
) -> int:
    """Start the engine process, then serve HTTP on ``sock`` until SIGINT/SIGTERM (after
    the drain) or the engine's death; the exit status (1: the engine died).

    ``EngineStartupError`` if the engine cannot start; the engine is shut down on exit.
    One of several API servers (multi_server.py) attaches to the engine by ``link``
    instead and keeps the Responses API's stored responses in the SQLite file
    ``response_store``, which the others share.
    """
    disable_created_metrics()  # no *_created series, as in vLLM
    load_parser_plugins(args)  # imported already unless this is a spawned API server
    with stop_on_signal_while_starting() as signals:
        scheduler = vllm_config.scheduler_config
        stats = PrometheusStatLogger(
            vllm_config.model_config.name,
            max_model_len=scheduler.max_model_len,
            max_num_batched_tokens=scheduler.max_num_batched_tokens,
            max_loras=lora.max_loras if (lora := vllm_config.lora_config).enable_lora else 0,
            engine_stats=link is None or link.client_index == 0,
            multiprocess=link is not None,
            kv_cache_metrics=vllm_config.observability_config.kv_cache_metrics,
            custom_buckets=vllm_config.observability_config.custom_histogram_buckets,
            num_engines=vllm_config.parallel_config.data_parallel_size,
        )
        periodic = None if args.disable_log_stats else LoggingStatLogger()
        loggers = [stats] if periodic is None else [stats, periodic]
        maybe_attach_gc_debug_callback()
        engine = AsyncLLM(vllm_config, loggers, engine_factory=engine_factory, link=link)
        store = None
        try:
            if response_store is not None:
                store = SharedResponseStore(response_store)
            return await _start_and_serve(vllm_config, args, sock, engine, stats, store, periodic)
        except asyncio.CancelledError:
            if not signals:
                raise
            return 0  # a signal while starting: stopped as asked
        finally:
            engine.shutdown()
            if store is not None:
                store.close()


async def _start_and_serve(vllm_config, args, sock, engine, stats, store, periodic) -> int:
    """``run_server`` once its engine exists: wait for READY, build the app, serve."""
    log_task = gc_freeze = None
    try:
        # Before waiting for the engine (it loads in its own process meanwhile): a bad
        # --tool-server fails the start at once, before the server listens.
        tool_server = await connect_tool_server(args)
        info = await engine.start()
        logger.info(
            "Engine core ready: %d KV blocks of %d tokens (pid %d)",
            info["num_gpu_blocks"],
            vllm_config.cache_config.block_size,
            info["pid"],
        )
        if engine.default_sampling_params:  # vLLM's notice
            source = vllm_config.model_config.generation_config
            logger.warning(
                "Default sampling parameters have been overridden by %s: %s. If this is not "
                "intended, relaunch with --generation-config vllm.",
                "the model's generation_config.json" if source == "auto" else source,
                engine.default_sampling_params,
            )
        state = ServerState()
        app = build_app(
            vllm_config, args, engine, stats, state, instance_id(sock), store, tool_server
        )
        scheme = "https" if args.ssl_certfile else "http"
        if sock.family == socket.AF_UNIX:
            logger.info("Starting vLLM API server on %s over unix:%s", scheme, sock.getsockname())
        else:
            host, port = sock.getsockname()[:2]
            logger.info("Starting vLLM API server on %s://%s:%d", scheme, host, port)
        if periodic is not None:  # the throughput line (--disable-log-stats: none)
            log_task = asyncio.create_task(periodic.run())
        # The event loop streams every request: no full collection over start-up's heap.
        gc_freeze = freeze_gc_heap("API server")
        return await serve_http(app, sock, engine, args, state)
    finally:
        if gc_freeze is not None:
            gc_freeze.release()
        if log_task is not None:
            log_task.cancel()


class ToolServerStartupError(EngineStartupError):
    """--tool-server could not be used; reported by ``vllm serve`` as one line on stderr
    with exit status 1, like an engine that failed to start."""


async def connect_tool_server(args: FrontendArgs) -> MCPToolServer | None:
    """The MCP servers --tool-server names, connected (None without the flag);
    ``ToolServerStartupError`` if one is malformed or cannot be reached."""
    spec = getattr(args, "tool_server", None)
    if not spec:
        return None
    try:
        import mcp  # noqa: F401  (needed only with --tool-server)
    except ImportError:
        raise ToolServerStartupError(
            "--tool-server needs the mcp package: pip install 'vllm[mcp]'"
        ) from None
    try:
        return await MCPToolServer.connect(spec)
    except (ValueError, RuntimeError) as e:
        raise ToolServerStartupError(str(e)) from None


def dump_config(vllm_config: VllmConfig) -> str:
    """The config as JSON for the start-up log; a credential (a field declared
    ``secret``, e.g. --hf-token) shows as "***"."""
    from dataclasses import asdict, fields, is_dataclass

    out = asdict(vllm_config)
    for group in fields(vllm_config):
        config = getattr(vllm_config, group.name)
        for f in fields(config) if is_dataclass(config) else ():
            if f.metadata.get("secret") and out[group.name][f.name] is not None:
                out[group.name][f.name] = "***"
    return json.dumps(out, default=str)
