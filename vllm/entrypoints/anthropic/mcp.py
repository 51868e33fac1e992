"""Anthropic's MCP connector on ``/v1/messages`` (``mcp_servers``, ``mcp_toolset`` tools),
run by this server as the Responses API's mcp tools are (``responses_mcp.py``): the
servers' tools are given to the model as functions beside the request's own; a call to
one runs on the MCP server (an ``mcp_tool_use`` block, then its ``mcp_tool_result``), and
the model generates again with the result, until it answers, calls a tool of the
client's (``stop_reason`` ``tool_use``), runs out of ``max_tokens`` or
``MAX_MCP_ROUNDS`` generations have called MCP tools (the last one may call none).

A request's ``mcp_servers`` entry must be one of the servers given to ``--tool-server``
(matched by URL): this server reaches no other. Its ``authorization_token`` is sent as a
Bearer ``Authorization`` header. Its tools are enabled by an ``mcp_toolset`` tool naming
it (``default_config`` / ``configs``' ``enabled``; a pinned ``tools`` listing is used as
given), else by its ``tool_configuration`` (``enabled``, ``allowed_tools``: the older
scheme). ``defer_loading`` (tool search) is refused. An ``mcp_tool_listing`` block sent
back in the conversation is the listing of its server, as Anthropic's; one is output
when the request's ``anthropic-beta`` names ``mcp-client-2026-09-15``.

Each generation is a turn of the message's job, with ``last_step_unless_tool_call``: one
that calls a tool is pinned while the call runs, so the next finds its KV cache.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse, Response

from vllm.entrypoints.anthropic.protocol import (
    MessagesRequest,
    anthropic_usage,
    content_blocks,
    stop_reason,
    thinking_block,
    tool_input,
)
from vllm.entrypoints.anthropic.serving import (
    Tally,
    _BlockEvents,
    error_type,
    event,
    message_start,
    stream_blocks,
)
from vllm.entrypoints.openai.mcp_tools import MCPTool
from vllm.entrypoints.openai.protocol import loggable
from vllm.entrypoints.openai.responses_mcp import (
    MAX_MCP_ROUNDS,
    list_servers_tools,
    tool_function,
)
from vllm.entrypoints.openai.serving_chat import renamed
from vllm.entrypoints.openai.serving_engine import EngineStreamingResponse, error_event
from vllm.exceptions import VLLMValidationError

if TYPE_CHECKING:
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.openai.mcp_tools import MCPServer, MCPToolServer

logger = logging.getLogger(__name__)

LISTING_BETA = "mcp-client-2026-09-15"  # the beta whose responses carry mcp_tool_listing
TOOLSET_KEYS = ("type", "mcp_server_name", "cache_control", "configs", "default_config", "tools")
CONFIG_KEYS = ("enabled", "defer_loading")


@dataclass
class _Server:
    """One ``mcp_servers`` entry: the configured server it names, how to call it, which
    of its tools are enabled, and its listing when the request holds one."""

    name: str
    server: MCPServer
    headers: dict[str, str] | None
    default: bool = True  # a tool is enabled unless said otherwise
    enabled: dict[str, bool] = field(default_factory=dict)  # per tool
    listing: list[MCPTool] | None = None  # pinned or sent back: not asked for again

    def keeps(self, name: str) -> bool:
        return self.enabled.get(name, self.default)


@dataclass
class McpConnector:
    """The request's MCP servers, resolved: the chat functions they add, the calls'
    routing by tool name, and the listings to output."""

    servers: list[_Server] = field(default_factory=list)
    functions: list[dict[str, Any]] = field(default_factory=list)
    routes: dict[str, _Server] = field(default_factory=dict)
    listings: list[dict[str, Any]] = field(default_factory=list)  # mcp_tool_listing blocks


def _bad(message: str, param: str) -> VLLMValidationError:
    return VLLMValidationError(message, param)


def _config(value: Any, where: str) -> bool | None:
    """A toolset config's ``enabled`` (None: not said); 400 for deferred loading."""
    if not isinstance(value, dict) or set(value) - set(CONFIG_KEYS):
        raise _bad(f'{where} must be {{"enabled": bool, "defer_loading": bool}}', "tools")
    if value.get("defer_loading") not in (None, False):
        raise _bad(
            f"{where}.defer_loading=true is not supported: this server loads every enabled "
            "MCP tool (there is no tool search)",
            "tools",
        )
    if not isinstance(value.get("enabled"), bool | None):
        raise _bad(f"{where}.enabled must be a boolean", "tools")
    return value.get("enabled")


def _tools_of(value: Any, where: str) -> list[MCPTool]:
    """A pinned listing (a toolset's ``tools``, an ``mcp_tool_listing`` block's)."""
    tools = []
    for k, tool in enumerate(value if isinstance(value, list) else [None]):
        if (
            not isinstance(tool, dict)
            or not isinstance(tool.get("name"), str)
            or not isinstance(tool.get("input_schema"), dict)
            or not isinstance(tool.get("description"), str | None)
        ):
            raise _bad(
                f"{where}.{k} must be {{'name', 'input_schema', 'description'?}}",
                where.split(".")[0],
            )
        tools.append(MCPTool(tool["name"], tool.get("description"), tool["input_schema"], None))
    return tools


def resolve(
    request: MessagesRequest, tool_server: MCPToolServer | None, headers: Mapping[str, str]
) -> McpConnector:
    """The request's servers and toolsets resolved (400s naming ``mcp_servers`` /
    ``tools``), their listings not fetched yet (``list_tools``)."""
    if tool_server is None:
        raise _bad(
            "mcp_servers need MCP servers this server reaches: start it with --tool-server",
            "mcp_servers",
        )
    connector = McpConnector()
    by_name: dict[str, _Server] = {}
    for i, spec in enumerate(request.mcp_servers or []):
        try:
            server = tool_server.find(spec["name"], spec["url"])
        except ValueError as e:
            raise _bad(f"mcp_servers.{i}: {e}", "mcp_servers") from None
        token = spec.get("authorization_token")
        entry = _Server(spec["name"], server, {"Authorization": f"Bearer {token}"} if token
                        else None)  # fmt: skip
        config = spec.get("tool_configuration") or {}
        if config.get("enabled") is False:
            entry.default = False
        elif config.get("allowed_tools") is not None:
            entry.default = False
            entry.enabled = dict.fromkeys(config["allowed_tools"], True)
        connector.servers.append(entry)
        by_name[entry.name] = entry
    seen: set[str] = set()
    for i, tool in enumerate(request.tools or []):
        if not (isinstance(tool, dict) and tool.get("type") == "mcp_toolset"):
            continue
        where = f"tools.{i}"
        name = tool.get("mcp_server_name")
        if set(tool) - set(TOOLSET_KEYS) or name not in by_name:
            raise _bad(
                f"{where}: an mcp_toolset takes {', '.join(TOOLSET_KEYS)} and its "
                f"mcp_server_name must be one of mcp_servers' names "
                f"({', '.join(map(repr, by_name))}), got {loggable(name)}",
                "tools",
            )
        if name in seen:
            raise _bad(f"{where}: a second mcp_toolset for {name!r}", "tools")
        seen.add(name)
        entry = by_name[name]
        spec = request.mcp_servers[[s.name for s in connector.servers].index(name)]
        if spec.get("tool_configuration") is not None:
            raise _bad(
                f"mcp_servers: {name!r} has an mcp_toolset: configure its tools there, "
                "not in tool_configuration",
                "mcp_servers",
            )
        default = _config(tool.get("default_config") or {}, f"{where}.default_config")
        entry.default = True if default is None else default
        configs = tool.get("configs") or {}
        if not isinstance(configs, dict):
            raise _bad(f"{where}.configs must map tool names to configs", "tools")
        for tool_name, value in configs.items():
            enabled = _config(value, f"{where}.configs.{tool_name}")
            if enabled is not None:
                entry.enabled[tool_name] = enabled
        if tool.get("tools") is not None:
            entry.listing = _tools_of(tool["tools"], f"{where}.tools")
    # Listings sent back (the last of each server's): not asked for again.
    for i, message in enumerate(request.messages):
        content = message.get("content") if isinstance(message, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, dict) and block.get("type") == "mcp_tool_listing":
                entry = by_name.get(block.get("mcp_server_name"))  # type: ignore[arg-type]
                if entry is not None and not any(
                    t.get("mcp_server_name") == entry.name and t.get("tools") is not None
                    for t in request.tools or [] if isinstance(t, dict)
                ):  # fmt: skip
                    entry.listing = _tools_of(block.get("tools"),
                                              f"messages.{i}.content.{j}.tools")  # fmt: skip
    return connector


async def list_tools(
    connector: McpConnector, tool_server: MCPToolServer, taken: set[str], output: bool
) -> None:
    """Fetch the listings the request lacks (424 if a server cannot list its tools) and
    make the enabled tools chat functions (a name given twice is a 400 naming
    ``tools``). ``output``: the fetched listings become ``mcp_tool_listing`` blocks."""
    fetch = [s for s in connector.servers if s.listing is None]
    listings = await list_servers_tools(tool_server, [(s.server, s.headers, s.name) for s in fetch])
    for entry, tools in zip(fetch, listings, strict=True):
        entry.listing = tools
        if output:
            connector.listings.append(listing_block(entry.name, tools))
    for entry in connector.servers:
        for tool in entry.listing or []:
            if not entry.keeps(tool.name):
                continue
            if tool.name in taken or tool.name in connector.routes:
                raise _bad(
                    f"tool name {tool.name!r} is given twice (by MCP server {entry.name!r} "
                    "and another tool): the model could not tell them apart",
                    "tools",
                )
            connector.routes[tool.name] = entry
            connector.functions.append(tool_function(tool, tool.description))


def listing_block(name: str, tools: list[MCPTool]) -> dict[str, Any]:
    listed = [{"name": t.name, "description": t.description, "input_schema": t.input_schema}
              for t in tools]  # fmt: skip
    return {"type": "mcp_tool_listing", "mcp_server_name": name, "tools": listed}


def as_mcp_blocks(blocks: list[dict[str, Any]], connector: McpConnector) -> list[dict[str, Any]]:
    """A generation's blocks, its calls to MCP tools as ``mcp_tool_use`` blocks."""
    out = []
    for block in blocks:
        if block["type"] == "tool_use" and block["name"] in connector.routes:
            block = {**block, "type": "mcp_tool_use",
                     "server_name": connector.routes[block["name"]].name}  # fmt: skip
        out.append(block)
    return out


async def run_call(
    tool_server: MCPToolServer, connector: McpConnector, use: dict[str, Any]
) -> dict[str, Any]:
    """The ``mcp_tool_result`` block of an ``mcp_tool_use`` block, once its call ran."""
    entry = connector.routes[use["name"]]
    result = await tool_server.call(entry.server, use["name"], use["input"], entry.headers)
    if result.error is None:
        text = result.output or ""
    else:  # the tool's own text when it has some, else what failed
        text = result.output or result.error.get("message") or str(result.error)
    return {
        "type": "mcp_tool_result",
        "tool_use_id": use["id"],
        "is_error": result.error is not None,
        "content": [{"type": "text", "text": text}],
    }


@dataclass
class _Run:
    """One message's loop: the conversation as it grows and the token counts."""

    serving: AnthropicServingMessages
    request: MessagesRequest
    headers: Mapping[str, str]
    message_id: str
    connector: McpConnector
    messages: list[dict[str, Any]]
    totals: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # prompt, out, cached, written
    round: int = 0

    async def start(self) -> tuple[Any, Any]:
        """The next generation: tool_choice as asked first, then auto while MCP calls may
        still be made, then none (the model answers)."""
        choice = None if self.round == 0 else ("auto" if self.round < MAX_MCP_ROUNDS else "none")
        chat = self.serving.chat
        chat_request = await self.serving._chat_request(
            self.request, self.headers, self.messages, self.connector.functions or None, choice
        )
        request_id = self.message_id if self.round == 0 else f"{self.message_id}-{self.round}"
        try:
            return await chat.start_generation(chat_request, request_id)
        except VLLMValidationError as e:
            raise renamed(e, MessagesRequest.FIELD_NAMES) from e

    def account(self, prompt: int, output: int, cached: int) -> None:
        written = self.serving.chat.cache_writes(prompt, cached)
        for i, n in enumerate((prompt, output, cached, written)):
            self.totals[i] += n

    @property
    def usage(self) -> dict[str, int]:
        prompt, output, cached, written = self.totals
        return anthropic_usage(prompt, output, cached, written)

    async def run_calls(self, blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The results of ``blocks``' MCP calls (in order); the generation and its results
        join the conversation as an assistant message."""
        uses = [b for b in blocks if b["type"] == "mcp_tool_use"]
        tool_server = self.serving.tool_server
        results = await asyncio.gather(*(run_call(tool_server, self.connector, u) for u in uses))
        self.messages.append({"role": "assistant", "content": [*blocks, *results]})
        self.round += 1
        return list(results)


def _ends(finish: str | None, blocks: list[dict[str, Any]]) -> bool:
    """Whether the loop ends after a generation: cut short, no MCP call to run, or a
    call of the client's (it runs that one; the MCP calls beside it run first)."""
    kinds = {b["type"] for b in blocks}
    return finish == "length" or "mcp_tool_use" not in kinds or "tool_use" in kinds


async def create_with_mcp(
    serving: AnthropicServingMessages,
    request: MessagesRequest,
    headers: Mapping[str, str],
    message_id: str,
    received: float | None,
    receive: Any,
) -> Response:
    """``create_message`` for a request with ``mcp_servers``: the loop's message (JSON) or
    its events (SSE)."""
    if request.context_management is not None:
        raise _bad(
            "context_management is not served with mcp_servers yet: send one or the other",
            "context_management",
        )
    connector = resolve(request, serving.tool_server, headers)
    taken = {t.get("name") for t in request.tools or [] if t.get("type", "custom") == "custom"}
    betas = headers.get("anthropic-beta", "")
    output_listings = LISTING_BETA in [b.strip() for b in betas.split(",")]
    await list_tools(connector, serving.tool_server, taken, output_listings)
    run = _Run(serving, request, headers, message_id, connector, list(request.messages))
    logger.info(
        "messages request %s: mcp_servers=%d mcp tools=%d stream=%s",
        message_id, len(connector.servers), len(connector.routes), request.stream,
    )  # fmt: skip
    plan, stream = await run.start()
    model = serving.chat.response_model(request.model)
    diagnostics = serving._diagnose(request, message_id, model, stream.prompt_token_ids)
    if request.stream:
        events = _stream(run, model, diagnostics, plan, stream, received)
        return EngineStreamingResponse(events, stream)
    content: list[dict[str, Any]] = list(connector.listings)
    while True:
        final = await serving.chat.collect(stream, receive)
        if final is None:
            return Response(status_code=499)  # the client left
        c = final.outputs[0]
        run.account(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens)
        message, _ = plan.message(c.text, c.finish_reason)
        blocks = as_mcp_blocks(content_blocks(message), connector)
        content += blocks
        if c.finish_reason == "length":
            break  # a call cut short is not run
        if any(b["type"] == "mcp_tool_use" for b in blocks):
            content += await run.run_calls(blocks)
        if _ends(c.finish_reason, blocks):
            break
        plan, stream = await run.start()
    called = any(b["type"] == "tool_use" for b in blocks)
    reason, sequence = stop_reason(c.finish_reason, c.stop_reason, called)
    body = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": run.usage,
    }
    if diagnostics is not None:
        body["diagnostics"] = diagnostics
    return JSONResponse(body, headers=serving.chat.timing(received, stream))


async def _stream(
    run: _Run,
    model: str,
    diagnostics: dict[str, Any] | None,
    plan: Any,
    stream: Any,
    received: float | None,
) -> AsyncIterator[str]:
    """The loop's events: each generation's blocks as they stream (an ``mcp_tool_use``
    block's input as ``input_json_delta``s), each call's ``mcp_tool_result`` block whole
    once it ran, then the next generation's blocks; usage (of all generations) and the
    stop reason in ``message_delta``."""
    chat = run.serving.chat
    blocks = _McpBlockEvents(run.connector)
    yield message_start(run.message_id, model, len(stream.prompt_token_ids), diagnostics)
    try:
        for listing in run.connector.listings:
            for chunk in blocks.whole(listing):
                yield chunk
        while True:
            tally = Tally(len(stream.prompt_token_ids))
            async for chunk in stream_blocks(chat, stream, plan, blocks, tally):
                yield chunk
            finish, matched = tally.finish, tally.matched
            run.account(tally.prompt, tally.output, tally.cached)
            generated = blocks.generated()
            if finish == "length":
                break
            if any(b["type"] == "mcp_tool_use" for b in generated):
                for result in await run.run_calls(generated):
                    for chunk in blocks.whole(result):
                        yield chunk
            if _ends(finish, generated):
                break
            await stream.aclose()
            plan, stream = await run.start()
            blocks.new_generation()
        reason, sequence = stop_reason(finish, matched, blocks.called)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield event("message_delta", delta=delta, usage=run.usage)
        yield event("message_stop")
        chat.timing(received, stream)
    except Exception as e:  # the status line is sent: the error goes in-band
        logger.warning("messages stream %s failed: %r", run.message_id, e)
        error = error_event(e)["error"]
        yield event("error", error={"type": error_type(error["code"]), "message": str(e)})
    finally:
        await stream.aclose()


class _McpBlockEvents(_BlockEvents):
    """``serving._BlockEvents`` across the loop's generations: a call to an MCP tool
    streams as an ``mcp_tool_use`` block; what a generation said is kept (``generated``)
    for the next generation's context."""

    def __init__(self, connector: McpConnector) -> None:
        super().__init__()
        self.connector = connector
        self.new_generation()

    def new_generation(self) -> None:
        self.calls = {}
        self.texts = {"thinking": "", "text": ""}
        self.uses: dict[int, dict[str, Any]] = {}  # call index -> its block, args as text
        self.client = False

    @property
    def called(self) -> bool:  # the client's tools only: it runs those
        return self.client

    def delta(self, delta: dict[str, Any]) -> list[str]:
        self.texts["thinking"] += delta.get("reasoning") or ""
        self.texts["text"] += delta.get("content") or ""
        return super().delta(delta)

    def _call(self, piece: dict[str, Any]) -> list[str]:
        out = []
        index, args = piece["index"], piece["function"].get("arguments") or ""
        if index not in self.calls:
            name = piece["function"]["name"]
            block: dict[str, Any] = {"type": "tool_use", "id": piece["id"], "name": name,
                                     "input": {}}  # fmt: skip
            if name in self.connector.routes:
                block = {**block, "type": "mcp_tool_use",
                         "server_name": self.connector.routes[name].name}  # fmt: skip
            else:
                self.client = True
            out += self._start(f"tool_use:{index}", block)
            self.calls[index] = self.count - 1
            self.uses[index] = {**block, "args": ""}
        if args:
            self.uses[index]["args"] += args
            delta = {"type": "input_json_delta", "partial_json": args}
            out.append(event("content_block_delta", index=self.calls[index], delta=delta))
        return out

    def whole(self, block: dict[str, Any]) -> list[str]:
        """A block sent whole (an MCP result, a listing): its start and its stop."""
        out = self._start("whole", block)
        out += self.close()
        return out

    def generated(self) -> list[dict[str, Any]]:
        """This generation's blocks, as ``content_blocks`` makes them (a call whose
        arguments are not a JSON object: its text)."""
        out: list[dict[str, Any]] = []
        if self.texts["thinking"]:
            out.append(thinking_block(self.texts["thinking"]))
        if self.texts["text"]:
            out.append({"type": "text", "text": self.texts["text"]})
        for index in sorted(self.uses):
            use = dict(self.uses[index])
            args = tool_input(use.pop("args"))
            if args is None:
                out.append({"type": "text", "text": self.uses[index]["args"]})
            else:
                out.append({**use, "input": args})
        return out
