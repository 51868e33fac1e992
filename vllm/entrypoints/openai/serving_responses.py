"""POST /v1/responses (the OpenAI Responses API) on the chat machinery, and the stored
responses' GET / DELETE / input_items.

A request becomes a ``ChatCompletionRequest`` (instructions as the system message, the
``previous_response_id`` chain's input and output items, then the new input, as chat
messages; function tools and ``tool_choice`` in chat's form), runs through
``OpenAIServingChat.start_generation`` (same template, tool parsing, guided decoding and
engine path as /v1/chat/completions), and its chat message is converted back into output
items.

Job identity (Continuum): a chain of responses is one job. Its id is the request's
``job_id`` (this server's extra), else ``prompt_cache_key``, else the session's identity
(``job_identity.py``: vLLM's ``session_id``, ``vllm_xargs.agentic_context.program_id``,
the ``X-Session-ID`` header), else the job of the previous response, else (a chain's
first response) the response's own id; it is stored with each response, so the whole
chain carries it.
Whether a turn ends the job is known only after its output, so unless the client sends
``is_last_step`` each turn is marked ``last_step_unless_tool_call``: a turn whose output
calls a function is pinned for the tool's duration (the agent comes back with its
output), and one that answers in plain text ends the job, its KV freed at once (the
policy parses the output's tool call).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from vllm.entrypoints.openai import openapi
from vllm.entrypoints.openai.job_identity import name_the_job
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, ErrorResponse, loggable
from vllm.entrypoints.openai.protocol_responses import (
    InputItemsQuery,
    ResponsesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
    new_id,
    normalize_input,
    output_items,
)
from vllm.entrypoints.openai.responses_store import (
    ResponseStore,
    SharedResponseStore,
    StoredResponse,
)
from vllm.entrypoints.openai.responses_stream import ResponseEvents
from vllm.entrypoints.openai.serving_chat import (
    OpenAIServingChat,
    converted_request_error,
    renamed,
)
from vllm.entrypoints.openai.serving_engine import EngineStreamingResponse, Receive
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.exceptions import VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import RequestStream
from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL

logger = logging.getLogger(__name__)

# The engine's finish reason -> the response's status (its items: "incomplete" unless
# the response completed).
_STATUS = {"length": "incomplete", "abort": "cancelled"}
DEFAULT_TEMPERATURE = SamplingParams().temperature


def not_found(response_id: str) -> HTTPException:
    return HTTPException(404, f"Response with id {loggable(response_id)} not found.")


class OpenAIServingResponses:
    """The Responses endpoints over ``chat`` (its engine, model and tool flags), with the
    stored responses in ``store``."""

    def __init__(
        self, chat: OpenAIServingChat, store: ResponseStore | SharedResponseStore | None = None
    ) -> None:
        self.chat = chat
        self.store = ResponseStore() if store is None else store  # an empty store is falsy

    # -- create ---------------------------------------------------------------------------
    async def create_response(
        self,
        request: ResponsesRequest,
        received: float | None = None,
        receive: Receive | None = None,
    ) -> Response:
        """The response object (JSON), or its events (SSE) if ``request.stream``;
        ``VLLMValidationError`` naming the Responses field for a request refused."""
        response_id = new_id("resp")
        job_id, items, chat_request = self._turn(request, response_id)
        logger.info(
            "responses request %s: job_id=%s previous=%s items=%d stream=%s",
            response_id,
            loggable(job_id),
            loggable(request.previous_response_id),
            len(items),
            request.stream,
        )
        try:
            plan, stream = await self.chat.start_generation(chat_request, response_id)
        except VLLMValidationError as e:
            raise renamed(e, ResponsesRequest.FIELD_NAMES) from e
        turn = _Turn(request, response_id, int(time.time()), items, job_id, chat_request)
        if request.stream:
            return EngineStreamingResponse(self._stream(turn, plan, stream, received), stream)
        final = await self.chat.collect(stream, receive)
        if final is None:
            return Response(status_code=499)  # the client left
        body = self._finish(turn, plan, final)
        return JSONResponse(body, headers=self.chat.timing(received, stream))

    def _turn(
        self, request: ResponsesRequest, response_id: str
    ) -> tuple[str, list, ChatCompletionRequest]:
        """The turn's job, its new input items and the chat request it runs as (the
        stored chain's items, then these)."""
        chain = self._chain(request.previous_response_id)
        job_id = request.job_id or request.prompt_cache_key
        job_id = job_id or (chain[-1].job_id if chain else response_id)
        items = normalize_input(request.input)
        history = [i for e in chain for i in (*e.input_items, *e.response["output"])]
        messages = items_to_messages(history + items)
        if request.instructions:
            messages.insert(0, {"role": "system", "content": request.instructions})
        return job_id, items, self._chat_request(request, messages, job_id)

    async def render_response(self, request: ResponsesRequest) -> dict[str, Any]:
        """POST /v1/responses/render (vLLM's): the /inference/v1/generate body the turn
        would run as (its stored chain included), nothing generated or stored."""
        _, _, chat_request = self._turn(request, new_id("resp"))
        try:
            return await self.chat.render_chat(chat_request)
        except VLLMValidationError as e:
            raise renamed(e, ResponsesRequest.FIELD_NAMES) from e

    def _chain(self, previous_id: str | None) -> list[StoredResponse]:
        if previous_id is None:
            return []
        chain = self.store.chain(previous_id)
        if chain is None:
            raise VLLMValidationError(
                f"Previous response with id {loggable(previous_id)} not found (never stored, "
                "stored with store=false, deleted or evicted, or a response before it was).",
                "previous_response_id",
                code="previous_response_not_found",
            )
        return chain

    def _chat_request(
        self, request: ResponsesRequest, messages: list[dict], job_id: str
    ) -> ChatCompletionRequest:
        fields = {
            "model": request.model,
            "messages": messages,
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": chat_tools(request.tools),
            "tool_choice": chat_tool_choice(request.tool_choice),
            "parallel_tool_calls": request.parallel_tool_calls,
            "response_format": chat_response_format(request.text),
            "reasoning_effort": request.reasoning.effort if request.reasoning else None,
            "stream": request.stream,
            "user": request.user,
            "priority": request.priority,
            "job_id": job_id,
            "is_last_step": bool(request.is_last_step),
            # Unless the client says: the job ends with a turn that calls no function.
            "vllm_xargs": None
            if request.is_last_step is not None
            else {LAST_UNLESS_TOOL_CALL: True},
            "prompt_cache_key": request.prompt_cache_key,
            "prompt_cache_options": request.prompt_cache_options,
            "prompt_cache_retention": request.prompt_cache_retention,
        }
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None}
            )
        except ValidationError as e:
            raise converted_request_error(e, ResponsesRequest.FIELD_NAMES) from e

    # -- results --------------------------------------------------------------------------
    def _finish(self, turn: _Turn, plan: ToolPlan, final: RequestOutput) -> dict[str, Any]:
        c = final.outputs[0]
        status = _STATUS.get(c.finish_reason or "", "completed")
        message, _ = plan.message(c.text, c.finish_reason)
        output = output_items(message, _item_status(status))
        reasoning = self.chat.reasoning_tokens(turn.chat_request, plan, [c.token_ids]) or 0
        usage = self.usage(
            len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens, reasoning
        )
        return self._complete(turn, status, output, usage)

    def _complete(self, turn: _Turn, status: str, output: list, usage: dict) -> dict[str, Any]:
        """The final response object, stored if the request asked for it."""
        body = self.response_object(turn, status, output, usage)
        if turn.request.stored:
            self.store.put(StoredResponse(body, turn.items, turn.job_id))
        return body

    def usage(self, prompt: int, output: int, cached: int, reasoning: int = 0) -> dict[str, Any]:
        """OpenAI's Responses usage. ``cached``: prompt tokens served from the KV cache
        (as chat's ``cached_tokens``); the cache writes: ``OpenAIServingChat.cache_writes``.
        ``reasoning``: the output's
        reasoning tokens (with --reasoning-parser)."""
        return {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": self.chat.cache_writes(prompt, cached),
            },
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output,
        }

    def response_object(
        self, turn: _Turn, status: str, output: list, usage: dict | None
    ) -> dict[str, Any]:
        r = turn.request
        done = status != "in_progress"
        return {
            "id": turn.response_id,
            "object": "response",
            "created_at": turn.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "background": False,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls,
            "metadata": r.metadata or {},
            "model": self.chat.response_model(r.model),
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "prompt_cache_key": r.prompt_cache_key,
            "prompt_cache_retention": r.prompt_cache_retention,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "safety_identifier": r.safety_identifier,
            "store": r.stored,
            "temperature": DEFAULT_TEMPERATURE if r.temperature is None else r.temperature,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [],
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "truncation": "disabled",
            "usage": usage if done else None,
            "user": r.user,
        }

    async def _stream(
        self, turn: _Turn, plan: ToolPlan, stream: RequestStream, received: float | None
    ) -> AsyncIterator[str]:
        events = ResponseEvents()
        yield events.lifecycle(
            "response.created", self.response_object(turn, "in_progress", [], None)
        )
        yield events.lifecycle(
            "response.in_progress", self.response_object(turn, "in_progress", [], None)
        )
        streamer = plan.streamer()  # None: the output is plain text
        prompt = cached = 0
        output_ids: list[int] = []
        finish_reason = None
        try:
            async for out in stream:
                prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
                c = out.outputs[0]
                output_ids += c.token_ids
                finish_reason = c.finish_reason
                delta = {"content": c.text} if c.text else {}
                if streamer is not None:
                    delta = streamer.delta(c.text, c.finish_reason is not None)
                for chunk in _delta_events(events, delta):
                    yield chunk
            status = _STATUS.get(finish_reason or "", "completed")
            for chunk in events.finish(_item_status(status)):
                yield chunk
            reasoning = self.chat.reasoning_tokens(turn.chat_request, plan, [output_ids]) or 0
            usage = self.usage(prompt, len(output_ids), cached, reasoning)
            body = self._complete(turn, status, events.items, usage)
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield events.lifecycle(kind, body)
            self.chat.timing(received, stream)
        except Exception as e:  # the status line is sent: the error goes in-band
            logger.warning("responses stream %s failed: %r", turn.response_id, e)
            code = "invalid_request" if isinstance(e, ValueError) else "server_error"
            yield events.event("error", code=code, message=str(e), param=None)
            failed = self.response_object(turn, "failed", events.items, None)
            failed["error"] = {"code": code, "message": str(e)}
            yield events.lifecycle("response.failed", failed)
        finally:
            await stream.aclose()  # a client that left: abort its request in the engine

    # -- stored ---------------------------------------------------------------------------
    def retrieve(self, response_id: str) -> dict[str, Any]:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def input_items(self, response_id: str, query: InputItemsQuery) -> dict[str, Any]:
        """The response's own input items (not those of earlier responses in its chain),
        paginated as OpenAI: ``after`` an item id, ``limit``, ``order`` (desc first)."""
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        items = entry.input_items if query.order == "asc" else entry.input_items[::-1]
        if query.after is not None:
            ids = [i["id"] for i in items]
            if query.after not in ids:
                raise VLLMValidationError(
                    f"No input item with id {loggable(query.after)} in this response", "after"
                )
            items = items[ids.index(query.after) + 1 :]
        page = items[: query.limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }


class _Turn:
    """What a response keeps from its request while it generates."""

    def __init__(
        self,
        request: ResponsesRequest,
        response_id: str,
        created_at: int,
        items: list,
        job_id: str,
        chat_request: ChatCompletionRequest,
    ) -> None:
        self.request = request
        self.chat_request = chat_request  # what it was served as
        self.response_id = response_id
        self.created_at = created_at
        self.items = items
        self.job_id = job_id


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


def _delta_events(events: ResponseEvents, delta: dict[str, Any]) -> list[str]:
    out = events.reasoning(delta["reasoning"]) if delta.get("reasoning") else []
    if delta.get("content"):
        out += events.text(delta["content"])
    for piece in delta.get("tool_calls") or []:
        out += events.tool_call(piece)
    return out


# -- routes -------------------------------------------------------------------------------
def _documented(errors: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    shown = {code: {"model": ErrorResponse, "description": text} for code, text in errors.items()}
    return {**openapi.ERROR_RESPONSES, **shown}


_STORED_RESPONSES = _documented(
    {400: "Invalid query parameter.", 404: "No stored response with this id."}
)


def add_responses_routes(app: FastAPI, serving: OpenAIServingResponses, received_key: str) -> None:
    """POST /v1/responses; GET and DELETE /v1/responses/{id}; GET .../input_items.
    ``received_key``: the ASGI scope key of the request's arrival time."""

    @app.post("/v1/responses", responses=openapi.GENERATE_RESPONSES)
    async def create_response(request: ResponsesRequest, raw: Request):
        name_the_job(request, raw.headers, serving.chat.args.max_job_id_length)
        return await serving.create_response(request, raw.scope.get(received_key), raw.receive)

    if serving.chat.args.enable_scale_out:  # else a 403 (api_server's scale-out routes)

        @app.post("/v1/responses/render", responses=openapi.RENDER_RESPONSES)
        async def render_response(request: ResponsesRequest, raw: Request):
            name_the_job(request, raw.headers, serving.chat.args.max_job_id_length)
            return await serving.render_response(request)

    @app.get("/v1/responses/{response_id}", responses=_STORED_RESPONSES)
    async def retrieve_response(response_id: str):
        return serving.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", responses=_STORED_RESPONSES)
    async def delete_response(response_id: str):
        return serving.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items", responses=_STORED_RESPONSES)
    async def list_input_items(response_id: str, raw: Request):
        try:
            query = InputItemsQuery.model_validate(dict(raw.query_params))
        except ValidationError as e:
            first = e.errors()[0]
            param = str(first["loc"][0]) if first.get("loc") else None
            raise VLLMValidationError(f"{param}: {first['msg']}", param) from e
        return serving.input_items(response_id, query)
