"""The generation loop of a ``/v1/responses`` turn with mcp tools (``responses_mcp.py``
resolves the tools, makes the items and runs the calls): generate; run the MCP calls the
model made (or stop at a call that waits for approval, or a call of the client's); generate
again with their results; answered once the loop ends, or streamed as it goes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.entrypoints.openai.protocol import loggable
from vllm.entrypoints.openai.responses_mcp import (
    MAX_MCP_ROUNDS,
    McpTools,
    approved_calls,
    as_mcp_items,
    new_id,
    prepare,
    run_call,
    split_tools,
)
from vllm.exceptions import VLLMValidationError

if TYPE_CHECKING:
    from vllm.entrypoints.openai.mcp_tools import MCPToolServer


@dataclass
class _McpRun:
    """One response's MCP loop: its context, its output so far, its token counts."""

    request: Any
    response_id: str
    job_id: str
    items: list
    context: list  # the chain's items and the request's
    mcp: McpTools
    tools: list
    first_choice: Any
    approved: list = field(default_factory=list)  # approved calls, run before generating
    output: list = field(default_factory=list)
    totals: list = field(default_factory=lambda: [0, 0, 0, 0])  # prompt, out, cached, reasoning
    round: int = 0

    @property
    def more_calls(self) -> bool:
        limit = self.request.max_tool_calls
        return self.round < MAX_MCP_ROUNDS and (limit is None or self.mcp.calls < limit)

    @property
    def choice(self) -> Any:
        return self.first_choice if self.round == 0 else ("auto" if self.more_calls else "none")

    @property
    def request_id(self) -> str:
        return self.response_id if self.round == 0 else f"{self.response_id}-{self.round}"

    def account(self, prompt: int, output: int, cached: int, reasoning: int) -> None:
        for i, n in enumerate((prompt, output, cached, reasoning)):
            self.totals[i] += n


def _ends(status: str, new: list[dict[str, Any]]) -> bool:
    """Whether the loop ends after a generation that output ``new``: cut short, no call
    to run, a call to one of the client's functions (the client runs it), or a call
    waiting for the client's approval."""
    calls = any(i["type"] == "mcp_call" for i in new)
    return (
        status != "completed"
        or not calls
        or any(i["type"] in ("function_call", "mcp_approval_request") for i in new)
    )


class McpResponsesMixin:
    """``OpenAIServingResponses``' turns with mcp tools: the generation loop above,
    answered once it ends, streamed as it goes, or run in the background (stored once it
    ends; its events logged as they go with ``stream``)."""

    tool_server: MCPToolServer | None

    async def _create_with_mcp(self, request, received, receive):
        from fastapi.responses import JSONResponse, Response

        from vllm.entrypoints.openai.serving_engine import EngineStreamingResponse

        run = await self._mcp_run(request)
        # The calls the client approved run first: the first generation reads their results.
        run.output += run.mcp.list_items + run.approved
        await asyncio.gather(*(run_call(self.tool_server, run.mcp, i) for i in run.approved))
        chat_request, prepared = await self._mcp_chat_request(run)
        turn = self._make_turn(request, run.response_id, run.items, run.job_id, chat_request)
        plan, stream = await self._start(chat_request, run.request_id, run.response_id, prepared)
        if request.background:
            return await self._start_background(turn, plan, stream, run)
        if request.stream:
            events = self._stream_mcp(run, turn, plan, stream, received)
            return EngineStreamingResponse(events, stream, self.chat.args.sse_keep_alive_interval)
        done = await self._collect_mcp(run, turn, plan, stream, receive)
        if done is None:
            return Response(status_code=499)  # the client left
        body, stream = done
        return JSONResponse(body, headers=self.chat.timing(received, stream))

    async def _collect_mcp(self, run: _McpRun, turn, plan, stream, receive=None):
        """The loop, unstreamed: (the stored response object, the last generation's
        stream), or None if the client left (its requests aborted)."""
        chat_request = turn.chat_request
        while True:
            final = await self.chat.collect(stream, receive)
            if final is None:
                return None
            c = final.outputs[0]
            status = _status(c.finish_reason)
            message, _ = plan.message(c.text, c.finish_reason)
            reasoning = self.chat.reasoning_tokens(chat_request, plan, [c.token_ids]) or 0
            run.account(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens,
                        reasoning)  # fmt: skip
            new = as_mcp_items(self._output_items(message, status), run.mcp)
            run.output += new
            calls = [i for i in new if i["type"] == "mcp_call"]
            await asyncio.gather(*(run_call(self.tool_server, run.mcp, i) for i in calls))
            if _ends(status, new):
                break
            run.round += 1
            chat_request, prepared = await self._mcp_chat_request(run)
            plan, stream = await self._start(
                chat_request, run.request_id, run.response_id, prepared
            )
            if turn.background:  # a cancel closes the run's current engine request
                self.background[run.response_id].stream = stream
        return self._complete(turn, status, run.output, self.usage(*run.totals)), stream

    async def _stream_mcp(self, run: _McpRun, turn, plan, stream, received):
        """The loop's events: the listings, then each generation's items as they stream;
        an MCP call's item ends once the call has run, and the next generation follows."""
        from vllm.entrypoints.openai.responses_stream import ResponseEvents, delta_events

        events = turn.events = ResponseEvents()
        events.mcp_labels = {name: e.label for name, e in run.mcp.routes.items()}
        events.mcp_asks = run.mcp.asks
        yield events.lifecycle("response.created", self.response_object(turn, "in_progress",
                                                                          [], None))  # fmt: skip
        yield events.lifecycle(
            "response.in_progress", self.response_object(turn, "in_progress", [], None)
        )
        for item in run.output:  # the listings, then the approved calls (already run)
            for chunk in events.mcp_listing(item) if item["type"] == "mcp_list_tools" else (
                events.mcp_call_done(item)
            ):  # fmt: skip
                yield chunk
        run.output = events.items  # the context of the next generations, as it grows
        try:
            while True:
                chat_request, first = turn.chat_request, len(events.items)
                output_ids, status, prompt, cached = [], "completed", 0, 0
                streamer = plan.streamer()
                async for out in stream:
                    c = out.outputs[0]
                    prompt, cached = len(out.prompt_token_ids), out.num_cached_tokens
                    output_ids += c.token_ids
                    status = _status(c.finish_reason)
                    delta = {"content": c.text} if c.text else {}
                    if streamer is not None:
                        delta = streamer.delta(c.text, c.finish_reason is not None)
                    for chunk in delta_events(events, delta):
                        yield chunk
                reasoning = self.chat.reasoning_tokens(chat_request, plan, [output_ids]) or 0
                run.account(prompt, len(output_ids), cached, reasoning)
                item_status = "completed" if status == "completed" else "incomplete"
                for chunk in events.finish(item_status):
                    yield chunk
                pending, events.pending_mcp = events.pending_mcp, []
                for index in pending:
                    yield events.mcp_call_running(index)
                calls = [events.items[i] for i in pending]
                await asyncio.gather(*(run_call(self.tool_server, run.mcp, i) for i in calls))
                for index in pending:
                    for chunk in events.mcp_call_ran(index):
                        yield chunk
                if _ends(status, events.items[first:]):
                    break
                run.round += 1
                events.new_round()
                turn.chat_request, prepared = await self._mcp_chat_request(run)
                await stream.aclose()
                plan, stream = await self._start(turn.chat_request, run.request_id,
                                                 run.response_id, prepared)  # fmt: skip
                if turn.background:  # a cancel closes the run's current engine request
                    self.background[run.response_id].stream = stream
            usage = self.usage(*run.totals)
            body = self._complete(turn, status, events.items, usage)
            kind = "response.completed" if status == "completed" else "response.incomplete"
            yield events.lifecycle(kind, body)
            self.chat.timing(received, stream)
        except Exception as e:  # the status line is sent: the error goes in-band
            yield events.event("error", code="server_error", message=str(e), param=None)
            yield events.lifecycle("response.failed", self._failed(turn, e, events.items))
        finally:
            await stream.aclose()

    async def _mcp_run(self, request) -> _McpRun:
        response_id = new_id("resp")
        job_id, items, history = self._context(request, response_id)
        rest, specs = split_tools(request.tools)
        listed = {i["server_label"] for i in history + items if i["type"] == "mcp_list_tools"}
        taken = {t.get("name") for t in rest or []}
        mcp = await prepare(specs, self.tool_server, listed, taken)
        tools, first_choice = self._mcp_tools_and_choice(request, rest, mcp)
        approved = approved_calls(mcp, history + items, items)
        return _McpRun(request, response_id, job_id, items, history + items, mcp, tools,
                       first_choice, approved)  # fmt: skip

    async def _mcp_chat_request(self, run: _McpRun):
        """The chat request of the loop's next generation: the context, the output so far
        (calls and their results), the tools; tool_choice as asked for the first
        generation, then auto while calls may still be made, then none. With truncation
        "auto", less the context's oldest items if they do not fit, and its prompt
        rendered (``_fitted``): (the chat request, that prompt or None)."""
        last_step = self._mcp_last_step(run.request)

        def build(messages):
            return self._chat_request(run.request, messages, run.job_id, tools=run.tools,
                                      tool_choice=run.choice, **last_step)  # fmt: skip

        first_new = len(run.context) - len(run.items)  # the output so far is new too
        return await self._fitted(run.request, run.context + run.output, first_new, build)

    def _mcp_tools_and_choice(self, request, rest, mcp: McpTools) -> tuple[list, Any]:
        """The chat tools (the request's functions, then the MCP servers') and the first
        generation's tool_choice; an mcp tool_choice (``{"type": "mcp", "server_label",
        "name"}``) forces that tool, or (no name) one of that server's."""
        from vllm.entrypoints.openai.protocol_responses import chat_tool_choice, chat_tools

        tools = [*(chat_tools(rest) or []), *mcp.functions]
        choice = request.tool_choice
        if not (isinstance(choice, dict) and choice.get("type") == "mcp"):
            return tools, chat_tool_choice(choice)
        label, name = choice.get("server_label"), choice.get("name")
        mine = [n for n, e in mcp.routes.items() if e.label == label]
        if not mine or (name is not None and name not in mine):
            raise VLLMValidationError(
                f"tool_choice names {loggable(label)}/{loggable(name)}, which is not one of "
                "the request's MCP tools",
                "tool_choice",
            )
        if name is not None:
            return tools, {"type": "function", "function": {"name": name}}
        return [t for t in tools if t["function"]["name"] in mine], "required"

    @staticmethod
    def _mcp_last_step(request) -> dict[str, Any]:
        """Each generation of the loop is a turn of the job: one that calls a tool is
        pinned while the call runs; a client's is_last_step=true ends the job with the
        generation that answers (not with the first)."""
        from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL

        if request.is_last_step is False:
            return {}
        return {"is_last_step": False, "vllm_xargs": {LAST_UNLESS_TOOL_CALL: True}}


def _status(finish_reason: str | None) -> str:
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")
