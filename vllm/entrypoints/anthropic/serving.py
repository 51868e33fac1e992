"""POST /v1/messages (the Anthropic Messages API) and /v1/messages/count_tokens, on the
chat machinery: the request becomes a ``ChatCompletionRequest`` (``protocol.to_chat``),
runs through ``OpenAIServingChat.start_generation`` (same template, tool parsing, guided
decoding, reasoning parser and engine path as /v1/chat/completions), and its chat message
is converted back into content blocks. Claude Code, the Claude Agent SDK and the official
``anthropic`` client talk to it with ``ANTHROPIC_BASE_URL`` pointing at the server.

Job identity (Continuum): the request's ``job_id`` (this server's extra), else the
router's identity (``vllm_xargs.agentic_context.program_id``, the ``X-Session-ID``
header), else the Claude Code session and conversation (``vllm_continuum.claude_code``:
the session id Claude Code sends, plus a digest of the subagent's id and the top-level
system prompt, so the main agent, its subagents and side requests are each a job).
Without ``is_last_step``, a turn that calls a tool is pinned for the tool's duration and
one that answers in text ends the job (``last_step_unless_tool_call``), as for
/v1/responses.

Errors are Anthropic's: ``{"type": "error", "error": {"type": ..., "message": ...}}``
(``anthropic_error``), in-band as an ``error`` event once a stream has started.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from vllm.entrypoints.anthropic.context_edits import apply_edits, needs_work, parse_edits
from vllm.entrypoints.anthropic.diagnostics import Fingerprint, Fingerprints
from vllm.entrypoints.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    content_blocks,
    template_kwargs,
    thinking_block,
    thinking_budget,
    to_chat,
)
from vllm.entrypoints.anthropic.protocol import anthropic_usage as usage_of
from vllm.entrypoints.anthropic.protocol import stop_reason as stop_reason_of
from vllm.entrypoints.openai.job_identity import name_the_job
from vllm.entrypoints.openai.mcp_tools import MCPToolServer
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, loggable
from vllm.entrypoints.openai.serving_chat import (
    OpenAIServingChat,
    converted_request_error,
    renamed,
)
from vllm.entrypoints.openai.serving_engine import (
    EngineStreamingResponse,
    Receive,
    error_event,
)
from vllm.entrypoints.openai.sse import idle_filled
from vllm.entrypoints.openai.tool_calling import ToolPlan
from vllm.exceptions import VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import RequestStream
from vllm_continuum import claude_code
from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL

logger = logging.getLogger(__name__)

MESSAGES_PATH = "/v1/messages"
# Seconds without output after which a stream sends a ping event (Anthropic's keep-alive);
# --sse-keep-alive-interval, when set, is the interval instead: this route's keep-alive is
# the ping event its clients know, not the SSE comment of the OpenAI routes.
PING_INTERVAL_S = 10.0
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"type": "error", "error": {"type": error_type(status), "message": message}},
    )


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def as_anthropic(response: Response) -> Response:
    """An OpenAI-shaped error response (``{"error": {"message", ...}}``) in Anthropic's
    shape, same status; any other response as it is."""
    try:
        message = json.loads(response.body)["error"]["message"]
    except (AttributeError, KeyError, TypeError, ValueError):
        return response
    return anthropic_error(response.status_code, message)


class AnthropicServingMessages:
    """The Messages endpoints over ``chat`` (its engine, model and tool flags)."""

    def __init__(self, chat: OpenAIServingChat, tool_server: MCPToolServer | None = None) -> None:
        self.chat = chat
        self.tool_server = tool_server  # --tool-server's servers: the MCP connector's
        self._inline_system: bool | None = None  # the template takes later system messages
        self.fingerprints = Fingerprints()  # of the requests that opted in to diagnostics

    # -- create ---------------------------------------------------------------------------
    async def create_message(
        self,
        request: MessagesRequest,
        headers: Mapping[str, str],
        received: float | None = None,
        receive: Receive | None = None,
    ) -> Response:
        """The message (JSON), or its events (SSE) if ``request.stream``;
        ``VLLMValidationError`` naming the Messages field for a request refused."""
        message_id = f"msg_{uuid.uuid4().hex}"
        if request.mcp_servers:  # the MCP connector's loop (mcp.py)
            from vllm.entrypoints.anthropic.mcp import create_with_mcp

            return await create_with_mcp(self, request, headers, message_id, received, receive)
        chat_request, applied, _ = await self._edited_chat_request(request, headers)
        edited = None if applied is None else {"applied_edits": applied}
        logger.info(
            "messages request %s: job_id=%s messages=%d tools=%d stream=%s",
            message_id,
            loggable(chat_request.job_id),
            len(request.messages),
            len(request.tools or ()),
            request.stream,
        )
        try:
            plan, stream = await self.chat.start_generation(chat_request, message_id)
        except VLLMValidationError as e:
            raise renamed(e, MessagesRequest.FIELD_NAMES) from e
        model = self.chat.response_model(request.model)
        diagnostics = self._diagnose(request, message_id, model, stream.prompt_token_ids)
        if request.stream:
            events = self._stream(message_id, model, diagnostics, edited, plan, stream, received)
            return EngineStreamingResponse(events, stream)
        final = await self.chat.collect(stream, receive)
        if final is None:
            return Response(status_code=499)  # the client left
        body = self._message(message_id, model, plan, final)
        if diagnostics is not None:
            body["diagnostics"] = diagnostics
        if edited is not None:
            body["context_management"] = edited
        return JSONResponse(body, headers=self.chat.timing(received, stream))

    async def render_message(self, request: MessagesRequest, headers: Mapping[str, str]) -> dict:
        """POST /v1/messages/render (vLLM's): the /inference/v1/generate body the request
        would run as (``OpenAIServingChat.render_chat`` of its chat request, after its
        ``context_management`` edits); nothing generated."""
        chat_request, _, _ = await self._edited_chat_request(request, headers)
        try:
            return await self.chat.render_chat(chat_request)
        except VLLMValidationError as e:
            raise renamed(e, MessagesRequest.FIELD_NAMES) from e

    def _diagnose(
        self, request: MessagesRequest, message_id: str, model: str, prompt: list[int]
    ) -> dict[str, Any] | None:
        """``diagnostics`` for a request that opted in (``diagnostics.py``); None else. Its
        own fingerprint is kept for the next turn to name."""
        if request.diagnostics is None:
            return None
        fingerprint = Fingerprint.of(request, model, prompt)
        previous = request.diagnostics.get("previous_message_id")
        reason = None
        if previous is not None:
            reason = fingerprint.miss_reason(self.fingerprints.get(previous))
        self.fingerprints.put(message_id, fingerprint)
        return {"cache_miss_reason": reason}

    async def count_tokens(self, request: CountTokensRequest) -> dict[str, Any]:
        """``{"input_tokens": N}``: the prompt the request would run with, checked as for
        generation; with ``context_management``, after its edits, and the count before
        them as ``context_management.original_input_tokens``."""
        chat_request, applied, count = await self._edited_chat_request(request, {})
        if count is None:  # not counted while editing
            count = await self._count(chat_request)
        if applied is None:
            return {"input_tokens": count}
        cleared = sum(edit["cleared_input_tokens"] for edit in applied)
        return {
            "input_tokens": count,
            "context_management": {"original_input_tokens": count + cleared},
        }

    async def _count(self, chat_request: ChatCompletionRequest) -> int:
        try:
            return len(await self.chat.prompt_token_ids(chat_request))
        except VLLMValidationError as e:
            raise renamed(e, MessagesRequest.FIELD_NAMES) from e

    async def _edited_chat_request(
        self, request: MessagesRequest | CountTokensRequest, headers: Mapping[str, str]
    ) -> tuple[ChatCompletionRequest, list[dict[str, Any]] | None, int | None]:
        """The chat request of ``request`` after its ``context_management`` edits, what
        they cleared (None: the request asked for no editing) and its prompt's tokens if
        the editing counted them (None otherwise)."""
        edits = parse_edits(request.context_management)
        if not edits:
            return await self._chat_request(request, headers), None, None
        messages, applied, tokens = request.messages, [], None
        if needs_work(edits):

            async def count(edited: list[dict[str, Any]]) -> int:
                return await self._count(await self._chat_request(request, headers, edited))

            messages, applied, tokens = await apply_edits(messages, edits, count)
        return await self._chat_request(request, headers, messages), applied, tokens

    async def _chat_request(
        self,
        request: MessagesRequest | CountTokensRequest,
        headers: Mapping[str, str],
        messages: list[dict[str, Any]] | None = None,
        mcp_tools: list[dict[str, Any]] | None = None,
        mcp_choice: Any = None,
    ) -> ChatCompletionRequest:
        """The chat request of ``request`` (``messages`` in place of its own, when given).
        ``mcp_tools``: the MCP connector's functions, after the request's tools; with them
        ``mcp_choice`` (when not None) is the generation's tool_choice, and a client's
        ``is_last_step: true`` ends the job with the generation that answers (``mcp.py``)."""
        conv = to_chat(request, messages)
        messages = conv.messages
        if any(m["role"] == "system" for m in messages[1:]) and not await self._takes_inline():
            messages = _merge_system(messages)
        choice, parallel = chat_tool_choice(request.tool_choice)
        mcp = bool(getattr(request, "mcp_servers", None))
        tools = chat_tools(request.tools, toolsets=mcp)
        if mcp_tools:
            tools = [*(tools or []), *mcp_tools]
            choice = choice if mcp_choice is None else mcp_choice
        if tools is not None and choice is None:
            choice = "auto"  # Anthropic's default with tools
        fields: dict[str, Any] = {
            "model": request.model,
            "messages": messages,
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
            "response_format": chat_response_format(request.output_config),
            "chat_template_kwargs": template_kwargs(
                request.thinking, request.output_config, request.chat_template_kwargs
            ),
        }
        if (request.thinking or {}).get("display") == "omitted":
            fields["include_reasoning"] = False  # no thinking block in the answer
        if isinstance(request, MessagesRequest):
            job = self._job(request, headers)
            last = request.is_last_step
            if mcp and last:  # the connector's calls are turns of the job: pinned as usual
                last = None
            fields |= {
                "thinking_token_budget": thinking_budget(request.thinking, request.max_tokens),
                "max_completion_tokens": request.max_tokens,
                "stop": request.stop_sequences,
                "stream": request.stream,
                "temperature": request.temperature,
                "top_p": request.top_p,
                "top_k": request.top_k,
                "priority": request.priority,
                "cache_salt": request.cache_salt,
                "job_id": job,
                "is_last_step": bool(last),
                # Unless the client says: the job ends with a turn that calls no tool.
                "vllm_xargs": {
                    **(request.vllm_xargs or {}),
                    **({LAST_UNLESS_TOOL_CALL: True} if last is None else {}),
                },
            }
        try:
            chat_request = ChatCompletionRequest.model_validate(
                {k: v for k, v in fields.items() if v is not None}
            )
        except ValidationError as e:
            raise converted_request_error(e, MessagesRequest.FIELD_NAMES) from e
        chat_request.cache_breakpoints = list(conv.cache_ttls)
        return chat_request

    def _job(self, request: MessagesRequest, headers: Mapping[str, str]) -> str | None:
        """The job ``request`` belongs to (see the module doc); None: a job of its own."""
        limit = self.chat.args.max_job_id_length
        if name_the_job(request, headers, limit) is not None and request.job_id is not None:
            return request.job_id
        job = claude_code.job_id(headers, {"system": request.system, "metadata": request.metadata})
        if job is not None and len(job) > limit:
            raise VLLMValidationError(
                f"The Claude Code session id names the job and must be at most "
                f"{limit - 13} characters (--max-job-id-length), got {len(job) - 13}",
                "metadata.user_id",
            )
        return job

    async def _takes_inline(self) -> bool:
        """Whether the chat template takes system messages after the first (Qwen's
        refuses them); probed once with a stand-in conversation."""
        if self._inline_system is None:
            probe = [
                {"role": "system", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "system", "content": "c"},
                {"role": "user", "content": "d"},
            ]
            engine = self.chat.engine

            def render() -> None:
                engine.apply_chat_template(probe, None, True, None, None)

            try:
                await self.chat.in_thread(render)
                self._inline_system = True
            except (jinja2.TemplateError, ValueError) as e:
                logger.warning(
                    "The chat template refuses system messages after the first (%s): those "
                    "of /v1/messages requests (Claude Code's reminders) are merged into the "
                    "leading system prompt, which then changes from turn to turn and misses "
                    "the prefix cache. A --chat-template that takes them avoids this.",
                    e,
                )
                self._inline_system = False
        return self._inline_system

    # -- results --------------------------------------------------------------------------
    def _message(
        self, message_id: str, model: str, plan: ToolPlan, final: RequestOutput
    ) -> dict[str, Any]:
        c = final.outputs[0]
        message, _ = plan.message(c.text, c.finish_reason)
        blocks = content_blocks(message)
        called = any(b["type"] == "tool_use" for b in blocks)
        reason, sequence = stop_reason_of(c.finish_reason, c.stop_reason, called)
        prompt, cached = len(final.prompt_token_ids), final.num_cached_tokens
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage_of(
                prompt, len(c.token_ids), cached, self.chat.cache_writes(prompt, cached)
            ),
        }

    async def _stream(
        self,
        message_id: str,
        model: str,
        diagnostics: dict[str, Any] | None,
        edited: dict[str, Any] | None,
        plan: ToolPlan,
        stream: RequestStream,
        received: float | None,
    ) -> AsyncIterator[str]:
        blocks = _BlockEvents()
        yield message_start(message_id, model, len(stream.prompt_token_ids), diagnostics)
        try:
            tally = Tally(len(stream.prompt_token_ids))
            async for chunk in stream_blocks(self.chat, stream, plan, blocks, tally):
                yield chunk
            prompt, cached, output = tally.prompt, tally.cached, tally.output
            reason, sequence = stop_reason_of(tally.finish, tally.matched, blocks.called)
            usage = usage_of(prompt, output, cached, self.chat.cache_writes(prompt, cached))
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            extra = {} if edited is None else {"context_management": edited}
            yield event("message_delta", delta=delta, usage=usage, **extra)
            yield event("message_stop")
            self.chat.timing(received, stream)
        except Exception as e:  # the status line is sent: the error goes in-band
            logger.warning("messages stream %s failed: %r", message_id, e)
            error = error_event(e)["error"]
            yield event("error", error={"type": error_type(error["code"]), "message": str(e)})
        finally:
            await stream.aclose()  # a client that left: abort its request in the engine


def event(kind: str, **fields: Any) -> str:
    payload = {"type": kind, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def message_start(
    message_id: str, model: str, prompt: int, diagnostics: dict[str, Any] | None
) -> str:
    """The ``message_start`` event, at once, as Anthropic's API: the prompt's usage so far
    (what the cache held is known after the prefill: ``message_delta`` carries the whole
    usage, which clients take over the start's)."""
    start = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage_of(prompt, 0, 0, 0),
    }
    if diagnostics is not None:
        start["diagnostics"] = diagnostics
    return event("message_start", message=start)


@dataclass
class Tally:
    """One streamed generation's counts and ending (``stream_blocks`` fills it)."""

    prompt: int
    cached: int = 0
    output: int = 0
    finish: str | None = None
    matched: Any = None  # the stop string or token that ended it


async def stream_blocks(
    chat: OpenAIServingChat, stream: RequestStream, plan: ToolPlan, blocks: Any, tally: Tally
) -> AsyncIterator[str]:
    """The content-block events of one generation as it streams (``blocks``: a
    ``_BlockEvents``), pings while nothing comes (queued or prefilling), its blocks
    closed at the end; ``tally`` holds its counts once done."""
    streamer = plan.streamer()  # None: the output is plain text
    interval = chat.args.sse_keep_alive_interval or PING_INTERVAL_S
    async with contextlib.aclosing(idle_filled(stream, interval, None)) as outputs:
        async for out in outputs:
            if out is None:  # tell the client we are here
                yield event("ping")
                continue
            tally.prompt, tally.cached = len(out.prompt_token_ids), out.num_cached_tokens
            c = out.outputs[0]
            tally.output += len(c.token_ids)
            tally.finish, tally.matched = c.finish_reason, c.stop_reason
            delta = {"content": c.text} if c.text else {}
            if streamer is not None:
                delta = streamer.delta(c.text, c.finish_reason is not None)
            for chunk in blocks.delta(delta):
                yield chunk
    for chunk in blocks.close():
        yield chunk


class _BlockEvents:
    """The content-block events of one streamed message, from chat deltas (``content``,
    ``reasoning``, ``tool_calls`` pieces): a block starts when its kind of output does and
    stops when the next one starts or the message ends."""

    def __init__(self) -> None:
        self.count = 0  # blocks started
        self.open: str | None = None  # "text" / "thinking" / "tool_use:<call index>"
        self.calls: dict[int, int] = {}  # tool call index -> block index

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out = []
        if delta.get("reasoning"):
            out += self._text("thinking", thinking_block(""), "thinking_delta", delta["reasoning"])
        if delta.get("content"):
            out += self._text("text", {"type": "text", "text": ""}, "text_delta", delta["content"])
        for piece in delta.get("tool_calls") or []:
            out += self._call(piece)
        return out

    def _text(self, kind: str, block: dict, delta_type: str, text: str) -> list[str]:
        out = [] if self.open == kind else self._start(kind, block)
        field = "thinking" if kind == "thinking" else "text"
        out.append(self._delta(self.count - 1, {"type": delta_type, field: text}))
        return out

    def _call(self, piece: dict[str, Any]) -> list[str]:
        out = []
        index, args = piece["index"], piece["function"].get("arguments") or ""
        if index not in self.calls:
            fn = piece["function"]
            block = {"type": "tool_use", "id": piece["id"], "name": fn["name"], "input": {}}
            out += self._start(f"tool_use:{index}", block)
            self.calls[index] = self.count - 1
        if args:
            delta = {"type": "input_json_delta", "partial_json": args}
            out.append(self._delta(self.calls[index], delta))
        return out

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        out.append(event("content_block_start", index=self.count, content_block=block))
        self.open, self.count = kind, self.count + 1
        return out

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=index, delta=delta)

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", index=self.count - 1)]


def _merge_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system messages after the first merged into a leading one (in order)."""
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest] if system else rest


# -- routes -------------------------------------------------------------------------------
def add_messages_routes(app: FastAPI, serving: AnthropicServingMessages, received_key: str) -> None:
    """POST /v1/messages, /v1/messages/count_tokens (and with --enable-scale-out
    /v1/messages/render). Their errors are reshaped by the
    app's handlers (``as_anthropic``)."""
    from vllm.entrypoints.openai import openapi

    @app.post(MESSAGES_PATH, responses=openapi.ANTHROPIC_RESPONSES)
    async def create_message(request: MessagesRequest, raw: Request):
        return await serving.create_message(
            request, raw.headers, raw.scope.get(received_key), raw.receive
        )

    @app.post(MESSAGES_PATH + "/count_tokens", responses=openapi.COUNT_TOKENS_RESPONSES)
    async def count_tokens(request: CountTokensRequest):
        return await serving.count_tokens(request)

    if serving.chat.args.enable_scale_out:  # else a 403 (api_server's scale-out routes)

        @app.post(MESSAGES_PATH + "/render", responses=openapi.RENDER_RESPONSES)
        async def render_message(request: MessagesRequest, raw: Request):
            return await serving.render_message(request, raw.headers)
