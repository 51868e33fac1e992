"""POST /v1/responses (the OpenAI Responses API) on the chat machinery, and the stored
responses' GET / DELETE / input_items.

A request becomes a ``ChatCompletionRequest`` (instructions as the system message, the
``previous_response_id`` chain's input and output items, then the new input, as chat
messages; function tools and ``tool_choice`` in chat's form), runs through
``OpenAIServingChat.start_generation`` (same template, tool parsing, guided decoding and
engine path as /v1/chat/completions), and its chat message is converted back into output
items.

Job identity (Continuum): a chain of responses is one job. Its id is the request's
``job_id`` (this server's extra), else ``prompt_cache_key``, else its ``conversation``'s id
(``conversations.py``: every turn of a conversation is one job), else the session's identity
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

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from vllm.entrypoints.openai import openapi
from vllm.entrypoints.openai.conversations import (
    ConversationStore,
    append_turn,
    conversation_history,
)
from vllm.entrypoints.openai.job_identity import name_the_job
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, ErrorResponse, loggable
from vllm.entrypoints.openai.protocol_responses import (
    InputItemsQuery,
    ResponsesRequest,
    RetrieveQuery,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    items_to_messages,
    new_id,
    normalize_input,
    output_items,
)
from vllm.entrypoints.openai.responses_background import CANCEL_POLL_S, EventLogs
from vllm.entrypoints.openai.responses_mcp import split_tools
from vllm.entrypoints.openai.responses_mcp_loop import McpResponsesMixin
from vllm.entrypoints.openai.responses_store import (
    ResponseStore,
    SharedResponseStore,
    StoredResponse,
)
from vllm.entrypoints.openai.responses_stream import ResponseEvents, delta_events
from vllm.entrypoints.openai.responses_truncation import Prepared, fit
from vllm.entrypoints.openai.serving_chat import (
    OpenAIServingChat,
    converted_request_error,
    renamed,
)
from vllm.entrypoints.openai.serving_engine import EngineStreamingResponse, Receive
from vllm.entrypoints.openai.sse import with_sse_keep_alive
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.exceptions import VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import RequestStream
from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL

if TYPE_CHECKING:
    from vllm.entrypoints.openai.mcp_tools import MCPToolServer

logger = logging.getLogger(__name__)

# The engine's finish reason -> the response's status (its items: "incomplete" unless
# the response completed).
_STATUS = {"length": "incomplete", "abort": "cancelled"}
_RUNNING = ("queued", "in_progress")  # a background response's states before its last
DEFAULT_TEMPERATURE = SamplingParams().temperature


def not_found(response_id: str) -> HTTPException:
    return HTTPException(404, f"Response with id {loggable(response_id)} not found.")


class OpenAIServingResponses(McpResponsesMixin):
    """The Responses endpoints over ``chat`` (its engine, model and tool flags), with the
    stored responses in ``store``."""

    def __init__(
        self, chat: OpenAIServingChat, store: ResponseStore | SharedResponseStore | None = None
    ) -> None:
        self.chat = chat
        self.store = ResponseStore() if store is None else store  # an empty store is falsy
        self.conversations = ConversationStore.sharing(self.store)  # shared as the store is
        self.background: dict[str, tuple[_Turn, asyncio.Task]] = {}  # running, by id
        self.tool_server: MCPToolServer | None = None  # --tool-server's MCP servers
        self.event_logs = EventLogs()

    # -- create ---------------------------------------------------------------------------
    async def create_response(
        self,
        request: ResponsesRequest,
        received: float | None = None,
        receive: Receive | None = None,
    ) -> Response:
        """The response object (JSON), or its events (SSE) if ``request.stream``;
        ``VLLMValidationError`` naming the Responses field for a request refused."""
        if split_tools(request.tools)[1]:
            return await self._create_with_mcp(request, received, receive)
        response_id = new_id("resp")
        job_id, items, chat_request, prepared = await self._turn(request, response_id)
        logger.info(
            "responses request %s: job_id=%s previous=%s items=%d stream=%s",
            response_id,
            loggable(job_id),
            loggable(request.previous_response_id),
            len(items),
            request.stream,
        )
        try:
            plan, stream = await self.chat.start_generation(
                chat_request, response_id, prepared=prepared
            )
        except VLLMValidationError as e:
            raise renamed(e, ResponsesRequest.FIELD_NAMES) from e
        turn = _Turn(request, response_id, int(time.time()), items, job_id, chat_request)
        if request.background:
            return await self._start_background(turn, plan, stream)
        if request.stream:
            keep_alive = self.chat.args.sse_keep_alive_interval
            events = self._stream(turn, plan, stream, received)
            return EngineStreamingResponse(events, stream, keep_alive)
        final = await self.chat.collect(stream, receive)
        if final is None:
            return Response(status_code=499)  # the client left
        body = self._finish(turn, plan, final)
        return JSONResponse(body, headers=self.chat.timing(received, stream))

    async def _turn(
        self, request: ResponsesRequest, response_id: str
    ) -> tuple[str, list, ChatCompletionRequest, Prepared | None]:
        """The turn's job, its new input items, the chat request it runs as (the stored
        chain's items, then these; with truncation "auto", less its oldest items if they
        do not fit) and, with "auto", its prompt rendered already (``_fitted``)."""
        job_id, items, history = self._context(request, response_id)

        def build(messages: list[dict]) -> ChatCompletionRequest:
            return self._chat_request(request, messages, job_id)

        chat_request, prepared = await self._fitted(request, history + items, len(history), build)
        return job_id, items, chat_request, prepared

    async def _fitted(
        self,
        request: ResponsesRequest,
        context: list,
        first_new: int,
        build: Callable[[list[dict]], ChatCompletionRequest],
    ) -> tuple[ChatCompletionRequest, Prepared | None]:
        """The chat request of ``context`` and, with truncation "auto", its prompt
        rendered (``responses_truncation.fit``)."""
        return await fit(self.chat, request, context, first_new, build, self._messages)

    def _context(self, request: ResponsesRequest, response_id: str) -> tuple[str, list, list]:
        """(the turn's job, its new input items, the stored chain's items before them)."""
        chain = self._chain(request.previous_response_id)
        conversation = request.conversation_id  # exclusive with a chain
        job_id = request.job_id or request.prompt_cache_key or conversation
        job_id = job_id or (chain[-1].job_id if chain else response_id)
        items = normalize_input(request.input)
        history = [i for e in chain for i in (*e.input_items, *e.response["output"])]
        history += conversation_history(self.conversations, conversation)
        return job_id, items, history

    @staticmethod
    def _messages(request: ResponsesRequest, items: list) -> list[dict]:
        messages = items_to_messages(items)
        if request.instructions:
            messages.insert(0, {"role": "system", "content": request.instructions})
        return messages

    async def render_response(self, request: ResponsesRequest) -> dict[str, Any]:
        """POST /v1/responses/render (vLLM's): the /inference/v1/generate body the turn
        would run as (its stored chain included), nothing generated or stored."""
        _, _, chat_request, _ = await self._turn(request, new_id("resp"))
        try:
            return await self.chat.render_chat(chat_request)
        except VLLMValidationError as e:
            raise renamed(e, ResponsesRequest.FIELD_NAMES) from e

    def _make_turn(self, request, response_id, items, job_id, chat_request) -> _Turn:
        return _Turn(request, response_id, int(time.time()), items, job_id, chat_request)

    async def _start(
        self,
        chat_request: ChatCompletionRequest,
        request_id: str,
        external_id: str,
        prepared: Prepared | None = None,
    ) -> tuple[ToolPlan, RequestStream]:
        try:
            return await self.chat.start_generation(chat_request, request_id, external_id, prepared)
        except VLLMValidationError as e:
            raise renamed(e, ResponsesRequest.FIELD_NAMES) from e

    @staticmethod
    def _output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
        return output_items(message, _item_status(status))

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
        if chain[-1].response["status"] in _RUNNING:  # a background one: no output yet
            raise VLLMValidationError(
                f"Previous response with id {loggable(previous_id)} is still "
                f"{chain[-1].response['status']}: continue it once it has finished.",
                "previous_response_id",
            )
        return chain

    def _chat_request(
        self, request: ResponsesRequest, messages: list[dict], job_id: str, **overrides: Any
    ) -> ChatCompletionRequest:
        """The chat request the turn (or, with MCP tools, one generation of it) runs as;
        ``overrides``: chat fields set otherwise (the MCP loop's tools and tool_choice)."""
        fields = {
            "model": request.model,
            "messages": messages,
            "max_completion_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": overrides.pop("tools") if "tools" in overrides else chat_tools(request.tools),
            "tool_choice": overrides.pop("tool_choice")
            if "tool_choice" in overrides
            else chat_tool_choice(request.tool_choice),
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
            **overrides,
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
        """The final response object, stored if the request asked for it; the turn's items
        appended to its conversation (whatever ``store``: OpenAI's semantics)."""
        body = self.response_object(turn, status, output, usage)
        if turn.request.stored:
            self._store(turn, body)
        if not turn.cancelled:
            conversation = turn.request.conversation_id
            append_turn(self.conversations, conversation, status, turn.items, output)
        return body

    def _failed(self, turn: _Turn, error: Exception, output: list) -> dict[str, Any]:
        """The response object of a generation that raised ``error``; stored if it ran in
        the background (a foreground one's client has the error, and nothing is stored)."""
        logger.warning("responses request %s failed: %r", turn.response_id, error)
        body = self.response_object(turn, "failed", output, None)
        body["error"] = {"code": _error_code(error), "message": str(error)}
        if turn.background:
            self._store(turn, body)
        return body

    def _store(self, turn: _Turn, body: dict[str, Any]) -> None:
        """Store ``body`` as the turn's response, unless it is a background one cancelled
        meanwhile (here, or by another API server sharing the store): that stays."""
        if turn.background:
            current = self.store.get(turn.response_id)
            if turn.cancelled or (current and current.response["status"] == "cancelled"):
                return
        self.store.put(StoredResponse(body, turn.items, turn.job_id))

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
        done = status not in _RUNNING
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
            "background": turn.background,
            "conversation": {"id": r.conversation_id} if r.conversation is not None else None,
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
            "truncation": r.truncation or "disabled",
            "usage": usage if done else None,
            "user": r.user,
        }

    async def _stream(
        self, turn: _Turn, plan: ToolPlan, stream: RequestStream, received: float | None
    ) -> AsyncIterator[str]:
        events = turn.events = ResponseEvents()
        created = "queued" if turn.background else "in_progress"
        yield events.lifecycle("response.created", self.response_object(turn, created, [], None))
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
                for chunk in delta_events(events, delta):
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
            yield events.event("error", code=_error_code(e), message=str(e), param=None)
            yield events.lifecycle("response.failed", self._failed(turn, e, events.items))
        finally:
            await stream.aclose()  # a client that left: abort its request in the engine

    # -- background -----------------------------------------------------------------------
    async def _start_background(
        self, turn: _Turn, plan: ToolPlan, stream: RequestStream, mcp_run: Any = None
    ) -> Response:
        """Store the turn ``queued`` and run it as a task: the response object at once,
        or (``stream``) its events as the task logs them."""
        queued = self.response_object(turn, "queued", [], None)
        if not self.store.put(StoredResponse(queued, turn.items, turn.job_id)):
            await stream.aclose()
            raise VLLMValidationError(
                "background=true: the request is too large to store", "background"
            )
        log = self.event_logs.new(turn.response_id) if turn.request.stream else None
        task = asyncio.create_task(
            self._run_background(turn, plan, stream, mcp_run), name=f"responses {turn.response_id}"
        )
        self.background[turn.response_id] = _Background(turn, task, stream)
        if log is not None:  # not EngineStreamingResponse: a client that leaves aborts nothing
            return self._follow(log.follow())
        return JSONResponse(queued)

    async def _run_background(
        self, turn: _Turn, plan: ToolPlan, stream: RequestStream, mcp_run: Any = None
    ) -> None:
        """The task of a background turn (``mcp_run``: its MCP loop). The drain counts it
        as a request in flight: a shutdown lets it finish within --shutdown-timeout, then
        ends it (``failed``)."""
        state = self.chat.state
        state.active += 1
        watcher = None
        if isinstance(self.store, SharedResponseStore):  # another process may cancel it
            watcher = asyncio.create_task(self._watch_cancel(turn.response_id))
        try:
            self._store(turn, self.response_object(turn, "in_progress", [], None))
            if turn.request.stream:
                log = self.event_logs.get(turn.response_id)
                events = (
                    self._stream(turn, plan, stream, None)
                    if mcp_run is None
                    else self._stream_mcp(mcp_run, turn, plan, stream, None)
                )
                async for event in events:
                    log.append(event)
            else:
                try:
                    if mcp_run is None:
                        final = await self.chat.collect(stream)
                    else:
                        await self._collect_mcp(mcp_run, turn, plan, stream)
                except Exception as e:
                    self._failed(turn, e, [] if mcp_run is None else mcp_run.output)
                else:
                    if mcp_run is None:
                        self._finish(turn, plan, final)
        except asyncio.CancelledError:
            pass  # cancelled (POST .../cancel, DELETE): the canceller stores the response
        finally:
            state.active -= 1
            if watcher is not None:
                watcher.cancel()
            self.background.pop(turn.response_id, None)
            self.event_logs.finished(turn.response_id)
            await stream.aclose()  # no-op unless cancelled: aborts the engine request

    async def _watch_cancel(self, response_id: str) -> None:
        """Stop this process's run of ``response_id`` once the shared store says another
        API server cancelled (or deleted) it."""
        while response_id in self.background:
            await asyncio.sleep(CANCEL_POLL_S)
            entry = self.store.get(response_id)
            if entry is None or entry.response["status"] == "cancelled":
                await self._stop(response_id)
                return

    async def _stop(self, response_id: str) -> list[dict[str, Any]] | None:
        """End this process's run of ``response_id`` (its engine request aborted once
        this returns); the output items it had (None: no run here)."""
        run = self.background.get(response_id)
        if run is None:
            return None
        run.turn.cancelled = True  # whatever it was about to store stays unstored
        run.task.cancel()
        await asyncio.wait({run.task})
        # A task cancelled before it started ran none of its own clean-up.
        await run.stream.aclose()
        self.background.pop(response_id, None)
        self.event_logs.finished(response_id)
        items = run.turn.events.items if run.turn.events is not None else []
        return [
            {**i, "status": "incomplete"} if i.get("status") == "in_progress" else i for i in items
        ]

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """POST /v1/responses/{id}/cancel: a queued or running background response ends
        ``cancelled`` (its output so far kept); one that has finished comes back as it is
        (OpenAI: cancelling is idempotent); a foreground one is a 400."""
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        if not entry.response.get("background"):
            raise VLLMValidationError(
                "Cannot cancel a synchronous response: only a response created with "
                "background=true can be cancelled.",
                "response_id",
            )
        if entry.response["status"] not in _RUNNING:
            return entry.response
        # Another API server's run (shared store): it sees the mark and stops itself.
        output = await self._stop(response_id) or []
        body = {**entry.response, "status": "cancelled", "output": output}
        self.store.put(StoredResponse(body, entry.input_items, entry.job_id))
        return body

    # -- stored ---------------------------------------------------------------------------
    def retrieve(self, response_id: str, query: RetrieveQuery | None = None) -> Response:
        """The stored response object; with ``query.stream``, the events of a background
        streamed one, from sequence number ``starting_after + 1``, following it live."""
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        if query is None or not query.stream:
            return JSONResponse(entry.response)
        log = self.event_logs.get(response_id)
        if log is None:
            raise VLLMValidationError(
                f"Response {loggable(response_id)} has no events to stream here: only one "
                "created with background=true and stream=true has, on the API server that "
                "created it, while running and among its last finished ones.",
                "stream",
            )
        start = 0 if query.starting_after is None else query.starting_after + 1
        return self._follow(log.follow(start))

    def _follow(self, events: AsyncIterator[str]) -> StreamingResponse:
        """A background response's event log as SSE (with --sse-keep-alive-interval's
        comments while it waits for the next event)."""
        keep_alive = self.chat.args.sse_keep_alive_interval
        return StreamingResponse(
            with_sse_keep_alive(events, keep_alive), media_type="text/event-stream"
        )

    async def delete(self, response_id: str) -> dict[str, Any]:
        await self._stop(response_id)  # a background one still running: no longer needed
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
        self.background = bool(request.background)
        self.cancelled = False  # a background turn cancelled: stores nothing more
        self.events: ResponseEvents | None = None  # a streamed turn's, as it streams


class _Background:
    """A background turn running in this process: its task and its engine stream."""

    def __init__(self, turn: _Turn, task: asyncio.Task, stream: RequestStream) -> None:
        self.turn = turn
        self.task = task
        self.stream = stream


def _error_code(error: Exception) -> str:
    return "invalid_request" if isinstance(error, ValueError) else "server_error"


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


# -- routes -------------------------------------------------------------------------------
def _documented(errors: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    shown = {code: {"model": ErrorResponse, "description": text} for code, text in errors.items()}
    return {**openapi.ERROR_RESPONSES, **shown}


_STORED_RESPONSES = _documented(
    {400: "Invalid query parameter.", 404: "No stored response with this id."}
)
_CANCEL_RESPONSES = _documented(
    {400: "Not a background response.", 404: "No stored response with this id."}
)
QueryT = TypeVar("QueryT", InputItemsQuery, RetrieveQuery)


def add_responses_routes(app: FastAPI, serving: OpenAIServingResponses, received_key: str) -> None:
    """POST /v1/responses; GET and DELETE /v1/responses/{id}; GET .../input_items.
    ``received_key``: the ASGI scope key of the request's arrival time."""

    @app.post("/v1/responses", responses=openapi.GENERATE_RESPONSES)
    async def create_response(request: ResponsesRequest, raw: Request):
        if request.conversation is None:  # else the conversation names the job
            name_the_job(request, raw.headers, serving.chat.args.max_job_id_length)
        return await serving.create_response(request, raw.scope.get(received_key), raw.receive)

    if serving.chat.args.enable_scale_out:  # else a 403 (api_server's scale-out routes)

        @app.post("/v1/responses/render", responses=openapi.RENDER_RESPONSES)
        async def render_response(request: ResponsesRequest, raw: Request):
            if request.conversation is None:
                name_the_job(request, raw.headers, serving.chat.args.max_job_id_length)
            return await serving.render_response(request)

    @app.get("/v1/responses/{response_id}", responses=_STORED_RESPONSES)
    async def retrieve_response(response_id: str, raw: Request):
        return serving.retrieve(response_id, _query(RetrieveQuery, raw))

    @app.delete("/v1/responses/{response_id}", responses=_STORED_RESPONSES)
    async def delete_response(response_id: str):
        return await serving.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel", responses=_CANCEL_RESPONSES)
    async def cancel_response(response_id: str):
        return await serving.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items", responses=_STORED_RESPONSES)
    async def list_input_items(response_id: str, raw: Request):
        return serving.input_items(response_id, _query(InputItemsQuery, raw))


def _query(model: type[QueryT], raw: Request) -> QueryT:
    """The request's query as ``model``; a 400 naming the first bad parameter."""
    try:
        return model.model_validate(dict(raw.query_params))
    except ValidationError as e:
        first = e.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else None
        raise VLLMValidationError(f"{param}: {first['msg']}", param) from e
