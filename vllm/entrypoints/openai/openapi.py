"""``/openapi.json`` as the server really behaves: the error responses (OpenAI's error
shape, never FastAPI's 422), the content types of /health, /metrics and of streams, and
the limits this server enforces (configured ones filled in from ``FrontendArgs``).

The schema fuzzer in tests/entrypoints/openai/test_openapi_fuzz.py holds the server to it.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.protocol import MAX_CHAT_MESSAGES, ErrorResponse
from vllm.sampling_params import INT64_MAX, INT64_MIN, MIN_REPETITION_PENALTY

# The bounds SamplingParams enforces (it owns the checks; the schema only states them).
SAMPLING_BOUNDS: dict[str, dict[str, Any]] = {
    "n": {"minimum": 1},
    "max_tokens": {"minimum": 1},
    "max_completion_tokens": {"minimum": 1},
    "min_tokens": {"minimum": 0},
    "temperature": {"minimum": 0},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": INT64_MAX},
    "min_p": {"minimum": 0, "maximum": 1},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"minimum": MIN_REPETITION_PENALTY, "maximum": 2},
    "seed": {"minimum": INT64_MIN, "maximum": INT64_MAX},
}
# -1: the whole vocabulary; the maximum is the server's --max-logprobs (_add_limits).
LOGPROB_FIELDS = ("top_logprobs", "logprobs", "prompt_logprobs")  # completions' logprobs


# A route that reads its own JSON body (/invocations: a chat, completion or embedding
# request, told apart by its fields).
ANY_OBJECT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"type": "object"}}},
    }
}


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


def _text(description: str, media_type: str = "text/plain") -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


_AUTH = {401: _error("Missing or wrong API key (the server was started with --api-key).")}
_DOWN = {503: _error("The server is shutting down (SIGTERM/SIGINT): no new request.")}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {**_AUTH, **_DOWN}

GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion as JSON, or as server-sent events when stream is true "
        "(a failure after the first event is an error event, then [DONE]).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            # OpenAPI 3.1: the schema of one event.
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "data": {
                            "type": "string",
                            "description": "A JSON chunk, a JSON error, or [DONE] (last).",
                        }
                    },
                    "required": ["data"],
                }
            },
        },
    },
    400: _error("Invalid request; error.param names the field."),
    **_AUTH,
    404: _error(
        "The request's model is neither the served model nor a LoRA adapter it serves "
        "(NotFoundError, code model_not_found)."
    ),
    413: _error("The body is larger than --max-request-body-size."),
    500: _error(
        "The engine failed while serving this request (InternalServerError; the server "
        "goes on), or the engine process died (the server exits unless kept alive)."
    ),
    **_DOWN,
}

# The /inference/v1/generate body a /render route answers (protocol_generate.GenerateRequest).
_GENERATE_BODY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "token_ids": {"type": "array", "items": {"type": "integer"}},
        "sampling_params": {"type": "object"},
        "model": {"type": "string"},
        "stream": {"type": "boolean"},
        "priority": {"type": "integer"},
        "request_id": {"type": "string"},
        "cache_salt": {"type": "string"},
    },
    "required": ["token_ids", "sampling_params", "model"],
}
_RENDER_ERRORS = {k: v for k, v in GENERATE_RESPONSES.items() if k in (400, 401, 404, 413, 503)}

RENDER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The /inference/v1/generate body the request would run as: its "
        "prompt's token ids and its sampling parameters; nothing is generated (vLLM's "
        "render route; vllm-router's cache_aware reads token_ids).",
        "content": {"application/json": {"schema": _GENERATE_BODY}},
    },
    **_RENDER_ERRORS,
}

RENDER_LIST_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Per prompt, the /inference/v1/generate body it would run as.",
        "content": {"application/json": {"schema": {"type": "array", "items": _GENERATE_BODY}}},
    },
    **_RENDER_ERRORS,
}

GENERATE_TOKENS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Tokens out: request_id, choices (token_ids, finish_reason, "
        "stop_reason, logprobs; text in output_mode text), usage; with stream, SSE "
        "chunks of the same shape, then [DONE].",
        "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
    },
    **{k: v for k, v in GENERATE_RESPONSES.items() if k != 200},
}

DERENDER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The chat.completion (or text_completion) the route would have "
        "answered for the generate response's token ids.",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
    **_RENDER_ERRORS,
}

ABORT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "How many in-flight requests were stopped (finish_reason abort).",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
    **{k: v for k, v in GENERATE_RESPONSES.items() if k in (400, 401)},
}


def _json_object(description: str, properties: dict[str, Any], required: list[str]) -> dict:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_IDS = {"type": "array", "items": {"type": "integer"}}
TOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "The prompt's token ids (vLLM's /tokenize); token_strs with return_token_strs.",
        {
            "count": {"type": "integer"},
            "max_model_len": {"type": "integer"},
            "tokens": _IDS,
            "token_strs": {"type": ["array", "null"], "items": {"type": "string"}},
        },
        ["count", "max_model_len", "tokens", "token_strs"],
    ),
    **{k: v for k, v in GENERATE_RESPONSES.items() if k in (400, 401, 404, 413, 503)},
}

DETOKENIZE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "The token ids' text (vLLM's /detokenize).", {"prompt": {"type": "string"}}, ["prompt"]
    ),
    **{k: v for k, v in GENERATE_RESPONSES.items() if k in (400, 401, 404, 413, 503)},
}


PROFILE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Done by the engine core (--profiler-config)."},
    **{k: v for k, v in GENERATE_RESPONSES.items() if k in (401, 503)},
}
SLEEP_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Sleep mode's state after the call (VLLM_SERVER_DEV_MODE=1)."},
    **{k: v for k, v in GENERATE_RESPONSES.items() if k in (400, 401, 503)},
}
SERVER_INFO_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "The engine's configuration, the environment variables it reads, the system "
        "(VLLM_SERVER_DEV_MODE=1).",
        {"vllm_config": {}, "vllm_env": {"type": "object"}, "system_env": {"type": "object"}},
        ["vllm_config", "vllm_env", "system_env"],
    ),
    **{k: v for k, v in GENERATE_RESPONSES.items() if k in (400, 401)},
}
WEIGHT_TRANSFER_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "RL weight sync (VLLM_SERVER_DEV_MODE=1): a message (the five transfer "
        "routes), the version (/weight_info, /update_weight_version), the checksums or "
        "their comparison (/weight_checker), or the world size (/get_world_size).",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
    400: _error(
        "A bad body (error.param names the field), a call out of order (an update not "
        "started), or an engine without --weight-transfer-config or dense weights."
    ),
    **{k: v for k, v in GENERATE_RESPONSES.items() if k in (401, 503)},
}
RESET_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "Whether the prefix cache was emptied (false while blocks are in use).",
        {"success": {"type": "boolean"}},
        ["success"],
    ),
    **{k: v for k, v in GENERATE_RESPONSES.items() if k in (401, 503)},
}


def _objects(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """An array of objects with these properties."""
    item = {"type": "object", "properties": properties, "required": required}
    return {"type": "array", "items": item}


# The pooling routes' list envelope (OpenAI's embeddings shape) and their errors.
_LIST = {"id": {"type": "string"}, "object": {"type": "string"},
         "created": {"type": "integer"}, "model": {"type": "string"}}  # fmt: skip
_USAGE = {"type": "object"}
_POOLING_ERRORS = {
    k: v for k, v in GENERATE_RESPONSES.items() if k in (400, 401, 404, 413, 500, 503)
}

EMBEDDING_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "The inputs' embeddings in input order (--runner pooling), floats or base64 of "
        "little-endian float32.",
        {
            **_LIST,
            "data": _objects(
                {
                    "object": {"type": "string"},
                    "index": {"type": "integer"},
                    "embedding": {
                        "anyOf": [
                            {"type": "array", "items": {"type": "number"}},
                            {"type": "string"},
                        ]
                    },
                },
                ["object", "index", "embedding"],
            ),
            "usage": _USAGE,
        },
        ["object", "data", "model", "usage"],
    ),
    **_POOLING_ERRORS,
}
SCORE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "Each pair's score (vLLM's /score, --runner pooling): an embedding model's cosine "
        "similarity of the two embeddings, a one-label classifier's output for the pair.",
        {
            **_LIST,
            "data": _objects(
                {
                    "index": {"type": "integer"},
                    "object": {"type": "string"},
                    "score": {"type": "number"},
                },
                ["index", "object", "score"],
            ),  # fmt: skip
            "usage": _USAGE,
        },
        ["id", "object", "data", "model", "usage"],
    ),
    **_POOLING_ERRORS,
}
RERANK_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "The documents, most relevant first (the Jina / Cohere rerank API, as vLLM's).",
        {
            "id": {"type": "string"},
            "model": {"type": "string"},
            "usage": _USAGE,
            "results": _objects(
                {
                    "index": {"type": "integer"},
                    "document": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                    "relevance_score": {"type": "number"},
                },
                ["index", "document", "relevance_score"],
            ),  # fmt: skip
        },
        ["id", "model", "usage", "results"],
    ),
    **_POOLING_ERRORS,
}


class _AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error of /v1/messages, in Anthropic's shape."""

    type: Literal["error"]
    error: _AnthropicErrorDetail


def _anthropic_error(description: str) -> dict[str, Any]:
    return {"model": AnthropicErrorResponse, "description": description}


_ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _anthropic_error("Invalid request (invalid_request_error); the message names the field."),
    401: _anthropic_error(
        "Missing or wrong API key (authentication_error): --api-key, sent "
        "as x-api-key or Authorization: Bearer."
    ),
    404: _anthropic_error("The request's model is not served (not_found_error)."),
    413: _anthropic_error("The body is larger than --max-request-body-size (request_too_large)."),
    500: _anthropic_error("The engine failed while serving this request (api_error)."),
    503: _anthropic_error("The server is shutting down (overloaded_error)."),
}

ANTHROPIC_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The message as JSON, or as Anthropic's server-sent events when stream "
        "is true (message_start, content_block_start/delta/stop, message_delta, "
        "message_stop; a failure after the first event is an error event).",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    },
    **_ANTHROPIC_ERRORS,
}

COUNT_TOKENS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "The prompt's token count (Anthropic's count_tokens).",
        {"input_tokens": {"type": "integer"}},
        ["input_tokens"],
    ),
    **_ANTHROPIC_ERRORS,
}

MODEL_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _json_object(
        "The model card (OpenAI's Model; Anthropic's ModelInfo when the request carries "
        "anthropic-version).",
        {"id": {"type": "string"}},
        ["id"],
    ),
    404: {
        "description": "No model of this id is served (NotFoundError; not_found_error).",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
    **ERROR_RESPONSES,
}

HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _text("Healthy: empty body."),
    503: _text("Unhealthy: engine dead, stalled (--engine-stall-timeout) or shutting down."),
}

METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: _text("Prometheus text exposition format.")
}


def document_api(app: FastAPI, args: FrontendArgs, max_logprobs: int = 20) -> None:
    """Make ``app.openapi()`` describe the error responses, ``args``' limits and the
    engine's ``--max-logprobs`` (-1: no bound but the vocabulary)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _drop_422(schema)
            _add_limits(schema.get("components", {}).get("schemas", {}), args, max_logprobs)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _drop_422(schema: dict[str, Any]) -> None:
    # Validation errors are 400s here (OpenAI's shape), not FastAPI's 422.
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _add_limits(components: dict[str, Any], args: FrontendArgs, max_logprobs: int) -> None:
    logprob_bounds = {"minimum": -1}
    if max_logprobs != -1:
        logprob_bounds["maximum"] = max_logprobs
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = components.get(name, {}).get("properties", {})
        for field, bounds in SAMPLING_BOUNDS.items():
            if field in props:
                _each_number(props[field], bounds)
        for field in LOGPROB_FIELDS:
            if field in props:  # chat's boolean logprobs is left alone
                _each_number(props[field], logprob_bounds)
        if "n" in props:
            props["n"]["maximum"] = args.max_n_sequences
        if "job_id" in props:
            _each_string(props["job_id"], maxLength=args.max_job_id_length)
        if "stop" in props:
            _each_string(props["stop"], minLength=1, maxLength=args.max_stop_string_length)
            for option in props["stop"].get("anyOf", []):
                if option.get("type") == "array":
                    option["maxItems"] = args.max_stop_strings
        if "prompt" in props:
            _document_prompt(props["prompt"], args.max_n_sequences)
        if "messages" in props:
            props["messages"]["maxItems"] = MAX_CHAT_MESSAGES
        if "chat_template" in props and not args.trust_request_chat_template:
            # Refused unless the server trusts request templates: only null is valid.
            props["chat_template"] = {
                "type": "null",
                "description": "Refused unless --trust-request-chat-template.",
            }


def _each_string(prop: dict[str, Any], **constraints: Any) -> None:
    """Apply ``constraints`` to every string in ``prop`` (plain, anyOf, or array items)."""
    options = prop.get("anyOf", [prop])
    for option in options:
        if option.get("type") == "string":
            option.update(constraints)
        elif option.get("type") == "array" and option.get("items", {}).get("type") == "string":
            option["items"].update(constraints)


def _each_number(prop: dict[str, Any], bounds: dict[str, Any]) -> None:
    for option in prop.get("anyOf", [prop]):
        if option.get("type") in ("integer", "number"):
            option.update(bounds)


def _document_prompt(prop: dict[str, Any], max_prompts: int) -> None:
    """Non-empty text or token ids, or a batch of up to ``max_prompts`` of them (with
    ``n``: prompts times n sequences at most, --max-n-sequences)."""
    for option in prop.get("anyOf", [prop]):
        items = option.get("items", {})
        if option.get("type") == "string":
            option["minLength"] = 1
        elif items.get("type") == "string":
            option.update(minItems=1, maxItems=max_prompts)
            items["minLength"] = 1
        elif items.get("type") == "integer":
            option["minItems"] = 1
            items["minimum"] = 0
        elif items.get("type") == "array":
            option.update(minItems=1, maxItems=max_prompts)
            items["minItems"] = 1
            items.get("items", {})["minimum"] = 0
