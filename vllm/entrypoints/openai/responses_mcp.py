"""Remote MCP tools in ``/v1/responses`` (OpenAI's ``{"type": "mcp"}`` tool), run by this
server: it lists the MCP server's tools (an ``mcp_list_tools`` item), gives them to the
model as functions, runs the model's calls to them on the MCP server (``mcp_call`` items,
with their output) and generates again with the results, until the model answers, calls a
function tool of the client's, or a bound is reached.

Only the MCP servers given to ``--tool-server`` can be reached (``mcp_tools.py``): a
request names one by ``server_label`` or by its ``server_url``. A call that needs approval
(``require_approval``: OpenAI's default, ``"always"``, or a filter naming it) is not run:
the response ends with an ``mcp_approval_request`` item, and the client's next request
(``previous_response_id``) answers it with an ``mcp_approval_response`` input item; an
approved call runs before that response's first generation.

Each generation of the loop is a turn of the response's job: one that calls a tool is
pinned by Continuum while the MCP server runs it (``last_step_unless_tool_call``), so the
next generation finds its KV cache.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.entrypoints.openai.protocol import loggable
from vllm.entrypoints.openai.protocol_responses import new_id
from vllm.exceptions import GracefulHTTPError, VLLMValidationError

if TYPE_CHECKING:
    from vllm.entrypoints.openai.mcp_tools import MCPServer, MCPToolServer

MAX_MCP_ROUNDS = 16  # generations that call MCP tools, per response, at most
# An mcp tool's keys: OpenAI's, and which of them this server honours.
MCP_KEYS = frozenset({
    "type", "server_label", "server_url", "allowed_tools", "require_approval", "headers",
    "authorization", "server_description",
})  # fmt: skip
MCP_REFUSED = ("connector_id", "tunnel_id", "defer_loading", "allowed_callers")


class McpListToolsError(GracefulHTTPError):
    """A configured MCP server could not list its tools: 424, as OpenAI answers."""

    status = 424
    err_type = "Failed Dependency"


@dataclass
class _Server:
    """One mcp tool of the request: the configured server it names and how to call it."""

    label: str
    server: MCPServer
    headers: dict[str, str] | None
    allowed: list[str] | None
    read_only: bool | None
    description: str | None
    approval: Any = "always"  # require_approval as sent (None: OpenAI's default, always)

    def needs_approval(self, tool: Any) -> bool:
        """Whether a call to ``tool`` waits for the client's approval: never under
        "never" or a ``{"never": filter}`` it matches; under ``{"always": filter}`` alone,
        only when it matches; anything else asks (OpenAI's default)."""
        if self.approval == "never":
            return False
        if isinstance(self.approval, dict):
            if _matches(self.approval.get("never"), tool):
                return False
            if "always" in self.approval and "never" not in self.approval:
                return _matches(self.approval["always"], tool)
        return True


def _matches(selector: Any, tool: Any) -> bool:
    """Whether ``tool`` is among a ``{"tool_names", "read_only"}`` filter's (None: none)."""
    if selector is None:
        return False
    names, read_only = selector.get("tool_names"), selector.get("read_only")
    if names is not None and tool.name not in names:
        return False
    return read_only is None or bool((tool.annotations or {}).get("readOnlyHint")) == read_only


@dataclass
class McpTools:
    """The request's mcp tools, resolved (``prepare``): the chat functions they add, the
    ``mcp_list_tools`` items to output, and the calls' routing by function name."""

    servers: list[_Server] = field(default_factory=list)
    functions: list[dict[str, Any]] = field(default_factory=list)  # chat tools
    list_items: list[dict[str, Any]] = field(default_factory=list)
    routes: dict[str, _Server] = field(default_factory=dict)  # tool name -> its server
    asks: set[str] = field(default_factory=set)  # the tools whose calls need approval
    calls: int = 0  # made so far in this response

    def owns(self, name: str) -> bool:
        return name in self.routes


def split_tools(
    tools: list[dict[str, Any]] | None,
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """(the request's other tools, its mcp tools)."""
    if not tools:
        return tools, []
    mcp = [t for t in tools if isinstance(t, dict) and t.get("type") == "mcp"]
    rest = [t for t in tools if not (isinstance(t, dict) and t.get("type") == "mcp")]
    return rest, mcp


def _bad(message: str) -> VLLMValidationError:
    return VLLMValidationError(message, "tools")


def _check_spec(spec: dict[str, Any], where: str) -> None:
    for key in MCP_REFUSED:
        if spec.get(key) is not None:
            raise _bad(f"{where}.{key} is not supported: name a --tool-server server")
    unknown = sorted(set(spec) - MCP_KEYS - set(MCP_REFUSED))
    if unknown:
        raise _bad(f"{where} has fields this server does not take: {unknown}")
    if not isinstance(spec.get("server_label"), str) or not spec["server_label"]:
        raise _bad(f"{where}.server_label must be a non-empty string")
    approval = spec.get("require_approval")
    if approval not in (None, "never", "always") and not _approval_filter(approval):
        raise _bad(
            f'{where}.require_approval must be "always", "never" or {{"always": filter, '
            f'"never": filter}} with filters {{"tool_names": [...], "read_only": bool}}; '
            f"got {loggable(approval)}"
        )
    headers = spec.get("headers")
    if headers is not None and not (
        isinstance(headers, dict) and all(isinstance(v, str) for v in headers.values())
    ):
        raise _bad(f"{where}.headers must map header names to strings")


def _approval_filter(approval: Any) -> bool:
    if not isinstance(approval, dict) or not approval or set(approval) - {"always", "never"}:
        return False
    for selector in approval.values():
        if not isinstance(selector, dict) or set(selector) - {"tool_names", "read_only"}:
            return False
        names, read_only = selector.get("tool_names"), selector.get("read_only")
        if names is not None and not (
            isinstance(names, list) and all(isinstance(n, str) for n in names)
        ):
            return False
        if read_only is not None and not isinstance(read_only, bool):
            return False
    return True


def _allowed(spec: dict[str, Any], where: str) -> tuple[list[str] | None, bool | None]:
    allowed = spec.get("allowed_tools")
    if allowed is None:
        return None, None
    if isinstance(allowed, list) and all(isinstance(n, str) for n in allowed):
        return allowed, None
    if isinstance(allowed, dict) and not set(allowed) - {"tool_names", "read_only"}:
        names, read_only = allowed.get("tool_names"), allowed.get("read_only")
        ok_names = names is None or (isinstance(names, list) and all(isinstance(n, str)
                                                                      for n in names))  # fmt: skip
        if ok_names and (read_only is None or isinstance(read_only, bool)):
            return names, read_only
    raise _bad(
        f"{where}.allowed_tools must be a list of tool names or "
        '{"tool_names": [...], "read_only": bool}'
    )


async def prepare(
    specs: list[dict[str, Any]],
    tool_server: MCPToolServer | None,
    listed: set[str],
    taken: set[str],
) -> McpTools:
    """Resolve the request's mcp tools (400 naming ``tools`` for one this server cannot
    serve), list each server's tools now, and make them chat functions. ``listed``: the
    labels whose ``mcp_list_tools`` item the response chain has already (not output
    again); ``taken``: the names of the request's function tools (a clash is a 400)."""
    mcp = McpTools()
    if not specs:
        return mcp
    if tool_server is None:
        raise _bad("mcp tools need MCP servers: start the server with --tool-server")
    for i, spec in enumerate(specs):
        where = f"tools[mcp {i}]"
        _check_spec(spec, where)
        try:
            server = tool_server.find(spec["server_label"], spec.get("server_url"))
        except ValueError as e:
            raise _bad(f"{where}: {e}") from None
        headers = dict(spec.get("headers") or {})
        if spec.get("authorization"):
            headers["Authorization"] = f"Bearer {spec['authorization']}"
        allowed, read_only = _allowed(spec, where)
        entry = _Server(spec["server_label"], server, headers or None, allowed, read_only,
                        spec.get("server_description"), spec.get("require_approval"))  # fmt: skip
        mcp.servers.append(entry)
    listings = await asyncio.gather(
        *(tool_server.list_tools(s.server, s.headers) for s in mcp.servers),
        return_exceptions=True,
    )
    for entry, tools in zip(mcp.servers, listings, strict=True):
        if isinstance(tools, asyncio.CancelledError):
            raise tools
        if isinstance(tools, Exception):
            raise McpListToolsError(
                f"Error retrieving tool list from MCP server {loggable(entry.label)}: {tools}"
            )
        kept = [t for t in tools if _keep(entry, t)]
        for tool in kept:
            if tool.name in taken or tool.name in mcp.routes:
                raise _bad(
                    f"tool name {loggable(tool.name)} is given twice (by MCP server "
                    f"{loggable(entry.label)} and another tool): the model could not tell "
                    "them apart"
                )
            mcp.routes[tool.name] = entry
            if entry.needs_approval(tool):
                mcp.asks.add(tool.name)
            about = tool.description or ""
            if entry.description:
                about = f"{about} ({entry.label}: {entry.description})".strip()
            fn = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
            if about:
                fn["description"] = about
            mcp.functions.append({"type": "function", "function": fn})
        if entry.label not in listed:
            mcp.list_items.append(list_tools_item(entry.label, kept))
    return mcp


def _keep(entry: _Server, tool: Any) -> bool:
    if entry.allowed is not None and tool.name not in entry.allowed:
        return False
    if entry.read_only is not None:
        read_only = bool((tool.annotations or {}).get("readOnlyHint"))
        return read_only == entry.read_only
    return True


def list_tools_item(label: str, tools: list[Any]) -> dict[str, Any]:
    return {
        "id": new_id("mcpl"),
        "type": "mcp_list_tools",
        "server_label": label,
        "tools": [
            {
                "name": t.name,
                "description": t.description,
                "input_schema": t.input_schema,
                "annotations": t.annotations,
            }
            for t in tools
        ],
        "error": None,
    }


def call_item(label: str, name: str, arguments: str, item_id: str | None = None) -> dict:
    """An ``mcp_call`` item, before its call has run (``status`` in_progress)."""
    return {
        "id": item_id or new_id("mcp"),
        "type": "mcp_call",
        "server_label": label,
        "name": name,
        "arguments": arguments,
        "output": None,
        "error": None,
        "status": "in_progress",
        "approval_request_id": None,
    }


def approval_item(label: str, name: str, arguments: str) -> dict[str, Any]:
    """An ``mcp_approval_request`` item: a call the client must approve before it runs."""
    return {"id": new_id("mcpr"), "type": "mcp_approval_request", "server_label": label,
            "name": name, "arguments": arguments}  # fmt: skip


def approved_calls(mcp: McpTools, context: list, items: list) -> list[dict[str, Any]]:
    """The calls the request's ``mcp_approval_response`` items approve, as mcp_call items
    to run now (each naming its request); a response naming no pending request in the
    conversation, or a tool the request's mcp tools do not give, is a 400."""
    asked = {i["id"]: i for i in context if i["type"] == "mcp_approval_request"}
    earlier = context[: len(context) - len(items)]  # the chain's, before this request's
    done = {i.get("approval_request_id") for i in context if i["type"] == "mcp_call"}
    done |= {i["approval_request_id"] for i in earlier if i["type"] == "mcp_approval_response"}
    calls = []
    for answer in (i for i in items if i["type"] == "mcp_approval_response"):
        request = asked.get(answer["approval_request_id"])
        if request is None or answer["approval_request_id"] in done:
            raise VLLMValidationError(
                f"No pending approval request with id {loggable(answer['approval_request_id'])}"
                " in this conversation",
                "input",
            )
        if not answer["approve"]:
            continue
        if request["name"] not in mcp.routes:
            raise _bad(
                f"the approved call's tool {loggable(request['name'])} is not one of the "
                "request's MCP tools"
            )
        item = call_item(mcp.routes[request["name"]].label, request["name"], request["arguments"])
        item["approval_request_id"] = request["id"]
        calls.append(item)
    return calls


async def run_call(tool_server: MCPToolServer, mcp: McpTools, item: dict[str, Any]) -> None:
    """Run the call of ``item`` (an mcp_call item, in place: its output or error, and its
    status). Arguments that are not a JSON object fail the call, not the response."""
    entry = mcp.routes[item["name"]]
    mcp.calls += 1
    try:
        arguments = json.loads(item["arguments"] or "{}")
    except json.JSONDecodeError as e:
        arguments, error = None, f"the arguments are not JSON: {e}"
    else:
        error = None if isinstance(arguments, dict) else "the arguments are not a JSON object"
    if error is not None:
        item.update(status="failed", error={"type": "mcp_protocol_error", "code": -32602,
                                            "message": error})  # fmt: skip
        return
    result = await tool_server.call(entry.server, item["name"], arguments, entry.headers)
    # OpenAI's: a failed call has its error and no output (the error holds the content)
    item.update(output=result.output if result.error is None else None, error=result.error)
    item["status"] = "failed" if result.error is not None else "completed"


def call_text(item: dict[str, Any]) -> str:
    """What the model reads of an mcp_call's result: its output, or its error."""
    if item.get("error") is None:
        return item.get("output") or ""
    return f"Error: {json.dumps(item['error'], ensure_ascii=False)}"


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
    answered once it ends, or streamed as it goes. Background runs are not built with mcp
    tools yet (a 400)."""

    tool_server: MCPToolServer | None

    async def _create_with_mcp(self, request, received, receive):
        from fastapi.responses import JSONResponse, Response

        from vllm.entrypoints.openai.serving_engine import EngineStreamingResponse

        if request.background:
            raise _bad(
                "mcp tools are not served with background=true yet: send the request "
                "without it (streamed or not)"
            )
        run = await self._mcp_run(request)
        # The calls the client approved run first: the first generation reads their results.
        run.output += run.mcp.list_items + run.approved
        await asyncio.gather(*(run_call(self.tool_server, run.mcp, i) for i in run.approved))
        chat_request = self._mcp_chat_request(run)
        turn = self._make_turn(request, run.response_id, run.items, run.job_id, chat_request)
        plan, stream = await self._start(chat_request, run.request_id, run.response_id)
        if request.stream:
            events = self._stream_mcp(run, turn, plan, stream, received)
            return EngineStreamingResponse(events, stream, self.chat.args.sse_keep_alive_interval)
        while True:
            final = await self.chat.collect(stream, receive)
            if final is None:
                return Response(status_code=499)  # the client left
            c = final.outputs[0]
            status = _status(c.finish_reason)
            message, _ = plan.message(c.text, c.finish_reason)
            reasoning = self.chat.reasoning_tokens(chat_request, plan, [c.token_ids]) or 0
            run.account(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens,
                        reasoning)  # fmt: skip
            new = _as_mcp_items(self._output_items(message, status), run.mcp)
            run.output += new
            calls = [i for i in new if i["type"] == "mcp_call"]
            await asyncio.gather(*(run_call(self.tool_server, run.mcp, i) for i in calls))
            if _ends(status, new):
                break
            run.round += 1
            chat_request = self._mcp_chat_request(run)
            plan, stream = await self._start(chat_request, run.request_id, run.response_id)
        body = self._complete(turn, status, run.output, self.usage(*run.totals))
        return JSONResponse(body, headers=self.chat.timing(received, stream))

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
                turn.chat_request = self._mcp_chat_request(run)
                await stream.aclose()
                plan, stream = await self._start(turn.chat_request, run.request_id,
                                                 run.response_id)  # fmt: skip
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

    def _mcp_chat_request(self, run: _McpRun):
        """The chat request of the loop's next generation: the context, the output so far
        (calls and their results), the tools; tool_choice as asked for the first
        generation, then auto while calls may still be made, then none."""
        messages = self._messages(run.request, run.context + run.output)
        last_step = self._mcp_last_step(run.request)
        return self._chat_request(run.request, messages, run.job_id, tools=run.tools,
                                  tool_choice=run.choice, **last_step)  # fmt: skip

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


def _as_mcp_items(items: list[dict[str, Any]], mcp: McpTools) -> list[dict[str, Any]]:
    """A generation's output items, its calls to MCP tools as mcp_call items (to run), or
    as mcp_approval_request items for those that need approval."""
    out = []
    for item in items:
        if item["type"] == "function_call" and mcp.owns(item["name"]):
            label = mcp.routes[item["name"]].label
            make = approval_item if item["name"] in mcp.asks else call_item
            item = make(label, item["name"], item["arguments"])
        out.append(item)
    return out
