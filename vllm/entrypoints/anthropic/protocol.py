"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): the
request model, the fields refused, and the conversion of a Messages request into a chat
request (the endpoint runs on the chat machinery: ``serving.py``).

What a Messages request becomes:

- ``system`` (a string or text blocks) is the leading system message. Claude Code's
  ``x-anthropic-billing-header`` block is dropped: it holds a hash that changes with
  every request, and kept first in the prompt it would miss the prefix cache every turn.
- A ``user`` message's ``tool_result`` blocks (first in the message, as Anthropic
  requires) become ``tool`` messages, in order, with their image blocks (a computer-use
  agent's screenshots) as image parts; its text and image blocks one user message after
  them.
- An ``assistant`` message's text blocks are its content, its ``thinking`` blocks its
  ``reasoning`` (vLLM's field: templates that keep reasoning read it), its ``tool_use``
  blocks its ``tool_calls``.
- ``cache_control`` (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) on any block or tool
  is a prompt-cache breakpoint: its ttl (5 minutes unless given) is a floor on the turn's
  KV pin, as OpenAI's ``prompt_cache_options.ttl`` (``vllm_continuum.cache_hints``).
- ``tools`` are function tools (``input_schema`` the parameters); ``tool_choice``
  ``auto`` / ``any`` / ``tool`` / ``none`` is chat's ``auto`` / ``required`` / named /
  ``none``; ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``.
- ``thinking``: ``disabled`` sets the template's ``enable_thinking`` false (Qwen3's
  switch, which the qwen3 reasoning parser follows); ``enabled`` / ``adaptive`` leave
  the model thinking; ``budget_tokens`` is vLLM's ``thinking_token_budget`` (the
  reasoning's end is forced after that many tokens; needs ``--reasoning-parser``).
- ``output_config.format`` (a JSON schema) is chat's ``response_format``;
  ``output_config.effort`` reaches the chat template as ``reasoning_effort``.

- ``mcp_servers`` and ``mcp_toolset`` tools (Anthropic's MCP connector) are run by this
  server (``mcp.py``); ``mcp_tool_use`` / ``mcp_tool_result`` blocks sent back read as the
  assistant's tool calls and their results, ``mcp_tool_listing`` blocks as nothing.

Images go to a model that takes them (a text-only model refuses them with a 400 naming
``messages``). Documents, other server tools (web search, code execution, ...) and
containers are refused with a 400 naming the field: no document is read and no other
server tool runs here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from vllm.entrypoints.anthropic.context_edits import parse_edits
from vllm.entrypoints.openai.protocol import (
    _check_nesting,
    _is_off,
    check_count,
    loggable,
    parse_cache_ttl,
)
from vllm.entrypoints.openai.protocol_responses import refuse_extras
from vllm.exceptions import VLLMValidationError
from vllm_continuum.claude_code import system_text

logger = logging.getLogger("vllm.entrypoints.anthropic.protocol")

DEFAULT_CACHE_TTL = "5m"  # Anthropic's ephemeral cache lifetime
CACHE_TTLS = ("5m", "1h")
MAX_STOP_SEQUENCES = 64


# Messages parameters this server does not implement, and the values that ask for nothing
# (clients sending defaults still work). Anything else is a 400 naming the field.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "service_tier": lambda v: v in (None, "auto", "standard_only"),
    "container": _is_off,
    "mcp_servers": _is_off,
    "inference_geo": _is_off,
    "speed": lambda v: v in (None, "standard"),
}
# Tool keys with nothing to do here at these values (a tool is called directly by the
# model, its schema always loaded; the input streams as it is written anyway).
TOOL_KEYS_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "eager_input_streaming": lambda v: True,
    "allowed_callers": lambda v: v is None or v == ["direct"],
    "defer_loading": lambda v: v in (None, False),
    "input_examples": _is_off,
}
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")


class MessagesRequest(BaseModel):
    """``POST /v1/messages``. ``job_id`` / ``is_last_step`` / ``priority`` /
    ``chat_template_kwargs`` / ``cache_salt`` / ``vllm_xargs`` are this server's extras
    (the anthropic client's ``extra_body``); without a job, the job is the router's
    identity or the Claude Code session's (``serving.py``)."""

    FIELD_NAMES: ClassVar[dict[str, str]] = {  # chat request field -> this request's
        "max_completion_tokens": "max_tokens",
        "stop": "stop_sequences",
        "response_format": "output_config.format",
        "prompt": "messages",
        "thinking_token_budget": "thinking.budget_tokens",
    }

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    metadata: dict[str, Any] | None = None
    stop_sequences: list[StrictStr] | None = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # A breakpoint on the last cacheable block: here, on the prompt as a whole.
    cache_control: dict[str, Any] | None = None
    # Anthropic's cache diagnostics (``diagnostics.py``): {"previous_message_id": id | null}.
    diagnostics: dict[str, Any] | None = None
    # Anthropic's context editing (``context_edits.py``).
    context_management: dict[str, Any] | None = None
    # Attribution for Anthropic's billing; one server is one workspace: nothing to do.
    user_profile_id: StrictStr | None = None
    workspace_id: StrictStr | None = None
    # Anthropic's MCP connector (``mcp.py``): [{"type": "url", "url", "name", ...}].
    mcp_servers: list[dict[str, Any]] | None = None
    # This server's extras.
    job_id: StrictStr | None = None
    is_last_step: StrictBool | None = None
    priority: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    cache_salt: StrictStr | None = None
    vllm_xargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _bound(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_nesting(data)
            check_count(data, "messages", "messages")
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> MessagesRequest:
        refuse_extras(self.model_extra or {}, UNSUPPORTED, "Messages")
        thinking_budget(self.thinking, self.max_tokens)
        parse_edits(self.context_management)
        check_mcp_servers(self.mcp_servers)
        diagnostics = self.diagnostics
        if diagnostics is not None and (
            set(diagnostics) - {"previous_message_id"}
            or not isinstance(diagnostics.get("previous_message_id", ""), str | None)
        ):
            raise VLLMValidationError(
                'diagnostics must be {"previous_message_id": <message id or null>}, got '
                f"{loggable(diagnostics)}",
                "diagnostics",
            )
        return self


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: what a Messages request would send, less its
    sampling; the answer is the prompt's token count."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _bound(cls, data: Any) -> Any:
        return MessagesRequest._bound(data)

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> CountTokensRequest:
        refuse_extras(self.model_extra or {}, UNSUPPORTED, "count_tokens")
        thinking_budget(self.thinking, None)
        parse_edits(self.context_management)
        return self


MCP_SERVER_KEYS = ("type", "url", "name", "authorization_token", "tool_configuration")


def check_mcp_servers(servers: list[dict[str, Any]] | None) -> None:
    """``mcp_servers``' shape (Anthropic's ``BetaRequestMCPServerURLDefinition``): each
    ``{"type": "url", "url", "name", "authorization_token"?, "tool_configuration"?}`` with
    a unique name; ``VLLMValidationError`` naming ``mcp_servers`` otherwise. Whether the
    URL is one this server reaches is checked when the request runs (``mcp.py``)."""
    names: set[str] = set()
    for i, server in enumerate(servers or []):
        where = f"mcp_servers.{i}"
        ok = (
            isinstance(server, dict)
            and server.get("type") == "url"
            and isinstance(server.get("url"), str)
            and isinstance(server.get("name"), str)
            and server["name"] != ""
            and isinstance(server.get("authorization_token"), str | None)
            and not set(server) - set(MCP_SERVER_KEYS)
        )
        if not ok:
            raise VLLMValidationError(
                f'{where} must be {{"type": "url", "url": <string>, "name": <string>}} with an '
                f"optional authorization_token and tool_configuration, got {loggable(server)}",
                "mcp_servers",
            )
        if server["name"] in names:
            raise VLLMValidationError(
                f"{where}.name {loggable(server['name'])} is given twice", "mcp_servers"
            )
        names.add(server["name"])
        config = server.get("tool_configuration")
        if config is None:
            continue
        allowed = config.get("allowed_tools") if isinstance(config, dict) else None
        if (
            not isinstance(config, dict)
            or set(config) - {"allowed_tools", "enabled"}
            or not isinstance(config.get("enabled"), bool | None)
            or not (allowed is None or (isinstance(allowed, list)
                                        and all(isinstance(n, str) for n in allowed)))
        ):  # fmt: skip
            raise VLLMValidationError(
                f'{where}.tool_configuration must be {{"enabled": bool, "allowed_tools": '
                f"[names]}} (both optional), got {loggable(config)}",
                "mcp_servers",
            )


def thinking_budget(thinking: dict[str, Any] | None, max_tokens: int | None) -> int | None:
    """The request's thinking budget in tokens (``thinking.budget_tokens`` when enabled),
    None when it sets none; ``VLLMValidationError`` naming ``thinking`` if malformed."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    keys = {"type"} | ({"display"} if kind in ("enabled", "adaptive") else set())
    keys |= {"budget_tokens"} if kind == "enabled" else set()
    if (
        kind not in THINKING_TYPES
        or set(thinking) - keys
        or thinking.get("display") not in (None, "summarized", "omitted")
    ):
        raise VLLMValidationError(
            'thinking must be {"type": "enabled", "budget_tokens": N}, {"type": "disabled"}, '
            '{"type": "adaptive"} or {"type": "between_tools"} (enabled and adaptive may set '
            f'display "summarized" or "omitted"), got {loggable(thinking)}',
            "thinking",
        )
    if kind != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
        raise VLLMValidationError(
            f"thinking.budget_tokens must be an integer >= 1024, got {loggable(budget)}",
            "thinking.budget_tokens",
        )
    if max_tokens is not None and budget >= max_tokens:
        raise VLLMValidationError(
            f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
            "thinking.budget_tokens",
        )
    return budget


# -- request -> chat ----------------------------------------------------------------------
class ChatConversion:
    """A Messages request's chat messages, tools and choices, and the ttls of its
    ``cache_control`` breakpoints (seconds, in order of appearance)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.cache_ttls: list[float] = []

    def mark(self, block: dict[str, Any], where: str = "") -> None:
        """Record ``block``'s ``cache_control`` breakpoint, if any (``where``: the
        block's path, empty for the request's own)."""
        control = block.get("cache_control")
        if control is None:
            return
        name = f"{where}.cache_control" if where else "cache_control"
        if (
            not isinstance(control, dict)
            or control.get("type") != "ephemeral"
            or set(control) - {"type", "ttl"}
            or control.get("ttl", DEFAULT_CACHE_TTL) not in CACHE_TTLS
        ):
            raise VLLMValidationError(
                f'{name} must be {{"type": "ephemeral"}} with an optional ttl of '
                f"{' or '.join(map(repr, CACHE_TTLS))}, got {loggable(control)}",
                name.split(".")[0],
            )
        self.cache_ttls.append(parse_cache_ttl(control.get("ttl", DEFAULT_CACHE_TTL), name))


def to_chat(
    request: MessagesRequest | CountTokensRequest, messages: list[dict[str, Any]] | None = None
) -> ChatConversion:
    """The chat messages of ``request`` (system first; ``messages`` in place of its own,
    when given) and its breakpoints; ``VLLMValidationError`` naming ``system`` /
    ``messages`` / ``tools`` for a block this server cannot take."""
    conv = ChatConversion()
    system = _system_text(request.system, conv)
    if system:
        conv.messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages if messages is None else messages):
        _convert_message(message, f"messages.{i}", conv)
    for i, tool in enumerate(request.tools or []):
        conv.mark(tool, f"tools.{i}")
    conv.mark({"cache_control": getattr(request, "cache_control", None)})
    return conv


def _system_text(system: str | list[dict[str, Any]] | None, conv: ChatConversion) -> str:
    """The system prompt's text, as the Claude Code job digest reads it (billing header
    left out), once its blocks are checked and their breakpoints recorded."""
    for i, block in enumerate(system if isinstance(system, list) else []):
        _text_of(block, f"system.{i}", "system")
        conv.mark(block, f"system.{i}")
    return system_text(system)


def _text_of(block: Any, where: str, param: str) -> str:
    if (
        not isinstance(block, dict)
        or block.get("type") != "text"
        or not isinstance(block.get("text"), str)
    ):
        raise VLLMValidationError(
            f"{where} must be a text block {{'type': 'text', 'text': <string>}}, got "
            f"{loggable(block)}",
            param,
        )
    return block["text"]


def _convert_message(message: Any, where: str, conv: ChatConversion, first: int = 0) -> None:
    """One Messages message as chat messages (``first``: the index of its first block in
    the message sent, when it is a piece of one)."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant", "system") or set(message) - {"role", "content"}:
        raise VLLMValidationError(
            f"{where} must be {{'role': 'user' | 'assistant', 'content': ...}}, got "
            f"{loggable(message)}",
            "messages",
        )
    content = message.get("content")
    if role == "assistant" and isinstance(content, list):
        # The MCP connector's results sit in the assistant's message, after its calls:
        # the chat context is the calls, the results as tool messages, then the rest.
        cut = next((j for j, b in enumerate(content) if _kind(b) == "mcp_tool_result"), None)
        if cut is not None:
            if any(_kind(b) != "mcp_tool_listing" for b in content[:cut]):
                _convert_message({"role": role, "content": content[:cut]}, where, conv, first)
            end = cut
            while end < len(content) and _kind(content[end]) == "mcp_tool_result":
                at = f"{where}.content.{first + end}"
                conv.mark(content[end], at)
                conv.messages.append(_tool_message(content[end], at, conv))
                end += 1
            if end < len(content):
                rest = {"role": role, "content": content[end:]}
                _convert_message(rest, where, conv, first + end)
            return
    if isinstance(content, str):
        conv.messages.append({"role": role, "content": content})
        return
    if not isinstance(content, list):
        raise VLLMValidationError(
            f"{where}.content must be a string or a list of content blocks", "messages"
        )
    if role == "system":  # an inline system message (Claude Code's reminders): text only
        texts = [_text_of(b, f"{where}.content.{j}", "messages") for j, b in enumerate(content)]
        for j, block in enumerate(content):
            conv.mark(block, f"{where}.content.{j}")
        conv.messages.append({"role": "system", "content": "".join(texts)})
        return
    texts: list[str] = []
    images: list[tuple[int, str]] = []  # (texts before it, its URL): a user's image blocks
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{first + j}"
        kind = block.get("type") if isinstance(block, dict) else None
        allowed = _BLOCKS[role]
        if kind not in allowed:
            raise VLLMValidationError(
                f"{at}: a {role} message may hold {', '.join(allowed)} blocks; got "
                f"{loggable(kind)}" + (" (documents are not read)" if kind == "document" else ""),
                "messages",
            )
        conv.mark(block, at)
        if kind == "text":
            texts.append(_text_of(block, at, "messages"))
        elif kind == "image":
            images.append((len(texts), _image_url(block, at)))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise VLLMValidationError(f"{at}.thinking must be a string", "messages")
            thinking.append(block["thinking"])
        elif kind in ("tool_use", "mcp_tool_use"):
            calls.append(_tool_call(block, at))
        elif kind in ("tool_result", "mcp_tool_result"):
            if texts:  # as Anthropic: the results answer the calls right before them
                raise VLLMValidationError(
                    f"{at}: tool_result blocks must come before any text in a message",
                    "messages",
                )
            conv.messages.append(_tool_message(block, at, conv))
        # redacted_thinking: opaque (Anthropic's encrypted reasoning): nothing to show;
        # mcp_tool_listing: the MCP connector's listing (the tools are the request's)
    if role == "user":
        if images:  # typed parts, in the blocks' order (the chat route loads the images)
            parts: list[dict[str, Any]] = []
            for i, text in enumerate(texts + [None]):
                parts += [_image_part(url) for before, url in images if before == i]
                if text is not None:
                    parts.append({"type": "text", "text": text})
            conv.messages.append({"role": "user", "content": parts})
        elif texts or not content:
            conv.messages.append({"role": "user", "content": "".join(texts)})
        return
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if thinking:
        out["reasoning"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    if out["content"] is None and not calls:
        out["content"] = ""
    conv.messages.append(out)


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else None


_BLOCKS = {
    "user": ("text", "image", "tool_result", "mcp_tool_result"),
    "assistant": (
        "text", "thinking", "redacted_thinking", "tool_use", "mcp_tool_use", "mcp_tool_listing",
    ),
}  # fmt: skip


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL the chat route loads: ``base64`` (its
    ``media_type`` and ``data`` as a data URL) or ``url``; Anthropic's ``file`` sources
    (the Files API) are refused."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if isinstance(media, str) and media.startswith("image/") and isinstance(data, str):
            return f"data:{media};base64,{data}"
    elif kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise VLLMValidationError(
        f"{where}.source must be {{'type': 'base64', 'media_type': 'image/...', 'data': ...}} "
        f"or {{'type': 'url', 'url': ...}}; got type {loggable(kind)}",
        "messages",
    )


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
        raise VLLMValidationError(
            f"{where}: a tool_use block needs a string id and name and an object input",
            "messages",
        )
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _tool_message(block: dict[str, Any], where: str, conv: ChatConversion) -> dict[str, Any]:
    """A ``tool_result`` block as a ``tool`` message. Its content blocks' texts join with
    newlines; its ``image`` blocks (a computer-use agent's screenshot) make the content
    typed parts, texts and images in the blocks' order, which the chat route loads as it
    loads a user's."""
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str):
        raise VLLMValidationError(f"{where}.tool_use_id must be a string", "messages")
    if isinstance(content, list):
        texts: list[str] = []
        parts: list[dict[str, Any]] = []
        for k, part in enumerate(content):
            at = f"{where}.content.{k}"
            if isinstance(part, dict) and part.get("type") == "image":
                parts.append(_image_part(_image_url(part, at)))
            else:
                text = _text_of(part, at, "messages")
                # Joined as the text-only form joins them: a newline between two texts.
                parts.append({"type": "text", "text": "\n" + text if texts else text})
                texts.append(text)
            conv.mark(part, at)
        images = len(parts) > len(texts)
        content = parts if images else "\n".join(texts)
    elif not isinstance(content, str):
        raise VLLMValidationError(
            f"{where}.content must be a string or a list of text and image blocks", "messages"
        )
    message = {"role": "tool", "tool_call_id": call_id, "content": content}
    if block.get("is_error") is True:  # for templates that render it
        message["is_error"] = True
    return message


TOOL_KEYS = ("type", "name", "description", "input_schema", "cache_control", "strict")


def chat_tools(
    tools: list[dict[str, Any]] | None, toolsets: bool = False
) -> list[dict[str, Any]] | None:
    """Custom tools as chat function tools; a server or Anthropic-defined tool (``type``
    other than ``custom``: web search, bash, text editor, ...) is a 400 naming ``tools``.
    ``mcp_toolset`` tools are left out when ``toolsets`` (the request's ``mcp_servers``
    resolve them: ``mcp.py``), a 400 otherwise."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind == "mcp_toolset" and toolsets:
            continue
        if kind == "mcp_toolset":
            raise VLLMValidationError(
                f"tools.{i}: an mcp_toolset names a server of the request's mcp_servers, "
                "and this request has none",
                "tools",
            )
        if kind != "custom":
            raise VLLMValidationError(
                f"tools.{i}: only custom tools (name, description, input_schema) are "
                f"supported, got type {loggable(kind)}",
                "tools",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not isinstance(schema, dict):
            raise VLLMValidationError(
                f"tools.{i} needs a string name and an object input_schema", "tools"
            )
        for key, value in tool.items():
            harmless = TOOL_KEYS_HARMLESS.get(key)
            if key not in TOOL_KEYS and (harmless is None or not harmless(value)):
                raise VLLMValidationError(
                    f"tools.{i}.{key}={loggable(value)} is not supported by this server", "tools"
                )
        fn: dict[str, Any] = {"name": name, "parameters": {"type": "object", **schema}}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        if tool.get("strict") is True:
            fn["strict"] = True
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """``tool_choice`` as chat's ``tool_choice`` and ``parallel_tool_calls``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if kind not in ("auto", "any", "tool", "none") or set(choice) - keys:
        raise VLLMValidationError(
            'tool_choice must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": '
            f"...}}, optionally with disable_parallel_tool_use; got {loggable(choice)}",
            "tool_choice",
        )
    parallel = (
        None
        if "disable_parallel_tool_use" not in choice
        else not choice["disable_parallel_tool_use"]
    )
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise VLLMValidationError("tool_choice.name must be a string", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"any": "required"}.get(kind, kind), parallel


EFFORTS = ("low", "medium", "high", "xhigh", "max")


def chat_response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": {...}}``) as chat's
    ``response_format`` (``effort``: ``template_kwargs``)."""
    if output_config is None:
        return None
    if set(output_config) - {"format", "effort"} or output_config.get("effort") not in (
        None,
        *EFFORTS,
    ):
        raise VLLMValidationError(
            f"output_config takes format and effort ({', '.join(EFFORTS)}), got "
            f"{loggable(output_config)}",
            "output_config",
        )
    fmt = output_config.get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
        or set(fmt) - {"type", "schema"}
    ):
        raise VLLMValidationError(
            'output_config.format must be {"type": "json_schema", "schema": {...}}, got '
            f"{loggable(fmt)}",
            "output_config.format",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def template_kwargs(
    thinking: dict[str, Any] | None,
    output_config: dict[str, Any] | None,
    kwargs: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """The request's ``chat_template_kwargs`` with what ``thinking`` and
    ``output_config.effort`` say, unless the request sets those variables itself:
    ``enable_thinking`` (false for ``disabled``: Qwen3's switch) and
    ``reasoning_effort`` (the effort, as vLLM passes it: gpt-oss's template and others
    read it; a template without the variable renders as without it)."""
    out = dict(kwargs or {})
    if thinking is not None:
        out.setdefault("enable_thinking", thinking["type"] != "disabled")
    effort = (output_config or {}).get("effort")
    if effort is not None:
        out.setdefault("reasoning_effort", effort)
    return out if out or kwargs is not None else None


# -- chat output -> content blocks --------------------------------------------------------
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat ``message`` (``ToolPlan.message``) as content blocks: its reasoning as a
    ``thinking`` block, its text as a ``text`` block (each none when empty), then one
    ``tool_use`` block per call (a call whose arguments are not a JSON object is kept
    as text: the client could not run it)."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning"):
        blocks.append(thinking_block(message["reasoning"]))
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        args = tool_input(fn["arguments"])
        if args is None:
            blocks.append({"type": "text", "text": fn["arguments"]})
        else:
            blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args})
    return blocks


def thinking_block(text: str) -> dict[str, Any]:
    # The signature is Anthropic's check that a thinking block came from its API; this
    # server checks none (clients send it back; it is ignored), so it is empty.
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def stop_reason(
    finish_reason: str | None, matched: int | str | None, called: bool
) -> tuple[StopReason | None, str | None]:
    """The engine's finish (``finish_reason``, ``matched``: the stop string it matched,
    if any) as Anthropic's ``stop_reason`` and ``stop_sequence``."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    if finish_reason is None:
        return None, None
    return "end_turn", None


def anthropic_usage(prompt: int, output: int, cached: int, written: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens neither read from the
    cache (``cached``) nor written to it (``written``)."""
    return {
        "input_tokens": prompt - cached - written,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


# -- models -------------------------------------------------------------------------------
def model_info(card: Any) -> dict[str, Any]:
    """A ``/v1/models`` card (``ModelCard``) as Anthropic's ``ModelInfo``: its context as
    ``max_input_tokens`` and ``max_tokens`` (a prompt and its output share it)."""
    created = datetime.fromtimestamp(card.created, UTC)
    return {
        "type": "model",
        "id": card.id,
        "display_name": card.id,
        "created_at": created.isoformat().replace("+00:00", "Z"),
        "lifecycle": "active",
        "max_input_tokens": card.max_model_len,
        "max_tokens": card.max_model_len,
    }


def model_list(cards: list[Any]) -> dict[str, Any]:
    """Anthropic's page of models: all of them, in one page."""
    data = [model_info(c) for c in cards]
    return {
        "data": data,
        "has_more": False,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }
