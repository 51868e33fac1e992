"""POST /v1/chat/completions/batch (vLLM's): several conversations, one response.

``messages`` is a list of conversations; every other field is a chat request's and
applies to each of them. Conversation ``i`` runs as its own chat request (engine id
``<id>-<i>``) and answers as choice ``i`` of one ``chat.completion``; the usage counts
them all. Each conversation is validated as a ``ChatCompletionRequest`` (so every chat
check applies, its errors naming ``messages[i]``) and rendered, tokenized and checked by
the engine before any is queued: a bad one fails the batch with nothing run. One failing
in the engine, or the client leaving, aborts them all. As vLLM's: no streaming, no tools,
no beam search, ``n`` 1 (each a 400 naming the field).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm.entrypoints.openai.job_identity import read_headers
from vllm.entrypoints.openai.openapi import GENERATE_RESPONSES
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, now_s
from vllm.entrypoints.openai.serving_chat import ENGINE_PROMPT_PARAMS, OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import OFFLOAD_CHARS, Receive, StreamBatch
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.exceptions import VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import RequestStream

logger = logging.getLogger(__name__)

BATCH_CHAT_PATH = "/v1/chat/completions/batch"
BATCH_CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    **GENERATE_RESPONSES,
    200: {
        "description": "One chat.completion: choice i answers conversation i; the usage "
        "counts them all.",
        "content": {"application/json": {"schema": {"type": "object"}}},
    },
}

# Fields a batch refuses (vLLM's limits), each with the values that ask for nothing.
_REFUSED = {
    "stream": (lambda v: v is None or v is False, "streaming"),
    "use_beam_search": (lambda v: v is None or v is False, "beam search"),
    "tools": (lambda v: not v, "tools"),
    "tool_choice": (lambda v: v is None or v == "none", "tool calls"),
    "n": (lambda v: v is None or v == 1, "n other than 1"),
}


class BatchChatCompletionRequest(BaseModel):
    """vLLM's batch chat request: ``messages`` holds one conversation per choice; the
    other fields (kept unvalidated here) are validated as each conversation's
    ``ChatCompletionRequest``. Refuses ``stream``, ``tools``, ``tool_choice`` (other than
    "none"), ``use_beam_search`` and ``n`` other than 1, naming the field."""

    model_config = ConfigDict(extra="allow", strict=True)

    messages: list[list[Any]] = Field(min_length=1)
    model: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        # A raw client's nested extra_body counts as the top level (the chat request folds
        # it in): a stream asked for there is refused as well.
        nested = data.get("extra_body")
        fields = {**nested, **data} if isinstance(nested, dict) else data
        for name, (harmless, what) in _REFUSED.items():
            if name in fields and not harmless(fields[name]):
                raise VLLMValidationError(
                    f"batch chat completions do not support {what}: omit {name}", name
                )
        return data

    def conversation(self, i: int) -> ChatCompletionRequest:
        """Conversation ``i`` as a chat request (``VLLMValidationError`` naming
        ``messages[i]``, or the shared field at fault)."""
        data = {**(self.model_extra or {}), "model": self.model, "messages": self.messages[i]}
        try:
            return ChatCompletionRequest.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e, i) from None


def _in_conversation(e: VLLMValidationError, i: int, always: bool = False) -> None:
    """Rename ``e`` for conversation ``i``: a prompt's error names ``messages[i]``;
    ``always``: the message says which conversation whatever the field (an engine
    limit such as a max_tokens past this conversation's context)."""
    param = e.param or ""
    prompt = param in ENGINE_PROMPT_PARAMS or param.split(".")[0] == "messages"
    if prompt:
        e.param = f"messages[{i}]"
    if prompt or always:
        e.args = (f"messages[{i}]: {e}", *e.args[1:])


def _validation_error(e: ValidationError, i: int) -> VLLMValidationError:
    first = e.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, VLLMValidationError):  # raised inside a protocol.py validator
        _in_conversation(cause, i)
        return cause
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] == "messages":
        where = ".".join([f"messages[{i}]", *loc[1:]])
        return VLLMValidationError(f"{where}: {first['msg']}", f"messages[{i}]")
    param = loc[0] if loc else None
    return VLLMValidationError(f"{'.'.join(loc)}: {first['msg']}", param)


class OpenAIServingChatBatch:
    """The batch route over the chat route's serving (its prompt rendering, tool plan,
    logprobs and usage): a batch runs exactly what its conversations would run on
    /v1/chat/completions."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def requests(
        self, batch: BatchChatCompletionRequest, headers: Mapping[str, str]
    ) -> list[ChatCompletionRequest]:
        """Each conversation's chat request, its headers read as the chat route reads
        them; at most --max-n-sequences conversations (as a completion batch's prompts)."""
        limit = self.chat.args.max_n_sequences
        if len(batch.messages) > limit:
            raise VLLMValidationError(
                f"at most {limit} conversations a batch (--max-n-sequences), "
                f"got {len(batch.messages)}",
                "messages",
            )
        requests = [batch.conversation(i) for i in range(len(batch.messages))]
        for request in requests:
            read_headers(request, headers, self.chat.args.max_job_id_length)
        return requests

    async def start_generations(
        self, requests: list[ChatCompletionRequest], engine_id: str, external_id: str
    ) -> tuple[list[ToolPlan], list[RequestStream]]:
        """Every conversation checked, rendered and tokenized (``prepare_request``), then
        all queued: each one's tool plan and output stream. Nothing is queued unless every
        conversation passed; a submit that fails aborts those already queued."""
        chat = self.chat
        chat.state.check_open()
        prepared_args = []
        for i, request in enumerate(requests):
            try:
                prepared_args.append(await chat._prepare(request))
            except VLLMValidationError as e:
                _in_conversation(e, i)
                raise
        prepared = [
            await self._engine_request(i, request, prompt, params, engine_id)
            for i, (request, (_, prompt, params)) in enumerate(
                zip(requests, prepared_args, strict=True)
            )
        ]
        _, prompts, params = zip(*prepared_args, strict=True)
        loras = [chat.check_model(request) for request in requests]
        streams = await chat.submit_all(prepared, prompts, params, loras, external_id)
        return [plan for plan, _, _ in prepared_args], streams

    async def _engine_request(
        self, i: int, request: ChatCompletionRequest, prompt: str, params, engine_id: str
    ):
        """Conversation ``i`` checked and tokenized by the engine (``prepare_request``),
        its images loaded first; nothing queued. Errors name ``messages[i]``."""
        chat = self.chat
        try:
            return await chat.engine.prepare_request(
                prompt,
                params,
                f"{engine_id}-{i}",
                priority=request.priority,
                executor=chat.executor() if len(prompt) >= OFFLOAD_CHARS else None,
                **await chat.engine_options(request),
            )
        except VLLMValidationError as e:
            _in_conversation(e, i, always=True)
            raise

    async def create_batch_chat_completion(
        self,
        batch: BatchChatCompletionRequest,
        headers: Mapping[str, str],
        received: float | None = None,
        receive: Receive | None = None,
    ) -> Response:
        """The ``chat.completion`` whose choice ``i`` answers conversation ``i``, or 499
        if the client left first (every conversation aborted)."""
        requests = self.requests(batch, headers)
        request_id, engine_id = self.chat.request_ids(requests[0], "chatcmpl")
        created = now_s()
        plans, streams = await self.start_generations(requests, engine_id, request_id)
        finals = await self.chat.collect_all(streams, receive)
        if finals is None:
            return Response(status_code=499)
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.chat.response_model(batch.model),
            **self.body(requests, plans, finals),
        }
        return JSONResponse(body, headers=self.chat.timing(received, StreamBatch(streams)))

    def choice(
        self, i: int, request: ChatCompletionRequest, plan: ToolPlan, final: RequestOutput
    ) -> dict:
        """Conversation ``i``'s reply as the chat route would write its only choice, with
        its own prompt's token ids and prompt logprobs when asked (vLLM puts them on a
        completion batch's choices)."""
        chat, [c] = self.chat, final.outputs
        message, finish_reason = plan.message(c.text, c.finish_reason)
        echo = request.echoed_text(plan.role)
        if echo:
            message["content"] = echo + (message.get("content") or "")
        hide = plan.hides_reasoning
        out = {
            "index": i,
            "message": message,
            "logprobs": None if hide else chat.chat_logprobs(c, chat.tokens_as_ids(request)),
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
        }
        if request.prompt_logprobs is not None:
            out["prompt_logprobs"] = chat.prompt_logprobs(final.prompt_logprobs)
        if request.return_token_ids:
            out["token_ids"] = None if hide else c.token_ids
            out["prompt_token_ids"] = final.prompt_token_ids
        return out

    def body(
        self,
        requests: list[ChatCompletionRequest],
        plans: list[ToolPlan],
        finals: list[RequestOutput],
    ) -> dict:
        """The response's choices (one per conversation, in order) and summed usage."""
        parts = list(zip(requests, plans, finals, strict=True))
        choices = [self.choice(i, *part) for i, part in enumerate(parts)]
        usage = self.chat.usage(finals).model_dump()
        counts = [
            self.chat.reasoning_tokens(r, p, [c.token_ids for c in f.outputs]) for r, p, f in parts
        ]
        if counts and counts[0] is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(counts)}
        return {"choices": choices, "usage": usage}


def add_batch_chat_route(
    app: FastAPI, chat: OpenAIServingChat, received_key: str, log_requests: bool
) -> None:
    """Register POST /v1/chat/completions/batch on ``app`` over the chat route's serving
    (``received_key``: the ASGI scope key of the request's arrival time)."""
    serving = OpenAIServingChatBatch(chat)

    @app.post(BATCH_CHAT_PATH, responses=BATCH_CHAT_RESPONSES)
    async def chat_batch(request: BatchChatCompletionRequest, raw: Request):
        if log_requests:
            logger.info("chat batch request: conversations=%d", len(request.messages))
        return await serving.create_batch_chat_completion(
            request, raw.headers, raw.scope.get(received_key), raw.receive
        )
