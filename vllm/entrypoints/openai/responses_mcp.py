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


def tools_error(message: str) -> VLLMValidationError:
    return VLLMValidationError(message, "tools")


def _check_spec(spec: dict[str, Any], where: str) -> None:
    for key in MCP_REFUSED:
        if spec.get(key) is not None:
            raise tools_error(f"{where}.{key} is not supported: name a --tool-server server")
    unknown = sorted(set(spec) - MCP_KEYS - set(MCP_REFUSED))
    if unknown:
        raise tools_error(f"{where} has fields this server does not take: {unknown}")
    if not isinstance(spec.get("server_label"), str) or not spec["server_label"]:
        raise tools_error(f"{where}.server_label must be a non-empty string")
    approval = spec.get("require_approval")
    if approval not in (None, "never", "always") and not _approval_filter(approval):
        raise tools_error(
            f'{where}.require_approval must be "always", "never" or {{"always": filter, '
            f'"never": filter}} with filters {{"tool_names": [...], "read_only": bool}}; '
            f"got {loggable(approval)}"
        )
    headers = spec.get("headers")
    if headers is not None and not (
        isinstance(headers, dict) and all(isinstance(v, str) for v in headers.values())
    ):
        raise tools_error(f"{where}.headers must map header names to strings")


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
    raise tools_error(
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
        raise tools_error("mcp tools need MCP servers: start the server with --tool-server")
    for i, spec in enumerate(specs):
        where = f"tools[mcp {i}]"
        _check_spec(spec, where)
        try:
            server = tool_server.find(spec["server_label"], spec.get("server_url"))
        except ValueError as e:
            raise tools_error(f"{where}: {e}") from None
        headers = dict(spec.get("headers") or {})
        if spec.get("authorization"):
            headers["Authorization"] = f"Bearer {spec['authorization']}"
        allowed, read_only = _allowed(spec, where)
        entry = _Server(spec["server_label"], server, headers or None, allowed, read_only,
                        spec.get("server_description"), spec.get("require_approval"))  # fmt: skip
        mcp.servers.append(entry)
    listings = await list_servers_tools(
        tool_server, [(s.server, s.headers, s.label) for s in mcp.servers]
    )
    for entry, tools in zip(mcp.servers, listings, strict=True):
        kept = [t for t in tools if _keep(entry, t)]
        for tool in kept:
            if tool.name in taken or tool.name in mcp.routes:
                raise tools_error(
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
            mcp.functions.append(tool_function(tool, about))
        if entry.label not in listed:
            mcp.list_items.append(list_tools_item(entry.label, kept))
    return mcp


async def list_servers_tools(
    tool_server: MCPToolServer, servers: list[tuple[MCPServer, dict[str, str] | None, str]]
) -> list[list[Any]]:
    """Each (server, headers, label)'s tools, listed now and at once; 424
    (``McpListToolsError``) naming the label of one that cannot list them."""
    listings = await asyncio.gather(
        *(tool_server.list_tools(server, headers) for server, headers, _ in servers),
        return_exceptions=True,
    )
    for (_, _, label), tools in zip(servers, listings, strict=True):
        if isinstance(tools, BaseException) and not isinstance(tools, Exception):
            raise tools  # cancellation
        if isinstance(tools, Exception):
            raise McpListToolsError(
                f"Error retrieving tool list from MCP server {loggable(label)}: {tools}"
            )
    return listings


def tool_function(tool: Any, description: str | None) -> dict[str, Any]:
    """An MCP tool as the chat function the model sees (no schema: any object)."""
    fn = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


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
            raise tools_error(
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


def as_mcp_items(items: list[dict[str, Any]], mcp: McpTools) -> list[dict[str, Any]]:
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
