"""The OpenAI Responses API (``/v1/responses``): the request model, the fields refused,
and the conversion of Responses items into chat messages and tools (the endpoint runs on
the chat machinery: ``serving_responses.py``).

Items are kept in their normalized form (every item has an ``id`` and a ``type``), which
is what ``GET /v1/responses/{id}/input_items`` lists and what a later turn's
``previous_response_id`` replays as chat messages.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator

from vllm.entrypoints.openai.protocol import (
    IMAGE_DETAILS,
    MAX_LOGGED_FIELDS,
    _check_nesting,
    _is_off,
    check_count,
    loggable,
)
from vllm.exceptions import VLLMValidationError

logger = logging.getLogger("vllm.entrypoints.openai.protocol_responses")

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")  # "text": as chat's own parts


# Responses parameters this server does not implement, and the values that ask for
# nothing (clients sending defaults still work). Anything else is a 400 naming the field.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "background_options": _is_off,
    "include": _is_off,
    "prompt": _is_off,  # stored prompt templates
    "top_logprobs": lambda v: v is None or v == 0,
    "service_tier": lambda v: v in (None, "auto", "default"),
    "stream_options": lambda v: _is_off(v) or v == {"include_obfuscation": False},
    "context_management": _is_off,
    "moderation": _is_off,
    "access_programs": _is_off,
    "image": _is_off,
}
MAX_METADATA = 16  # OpenAI's bounds on metadata: 16 pairs, 64-char keys, 512-char values


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ReasoningParams(BaseModel):
    """The Responses API's ``reasoning``: its ``effort`` reaches the chat template as
    chat's ``reasoning_effort`` does (vLLM's mapping). No summary can be written (a
    thinking model's reasoning comes back whole, with --reasoning-parser): asking for one
    is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Any = None
    generate_summary: Any = None

    @model_validator(mode="after")
    def _no_summary(self) -> ReasoningParams:
        if self.summary is not None or self.generate_summary is not None:
            raise VLLMValidationError(
                "reasoning.summary is not supported: no summary is written (with "
                "--reasoning-parser the reasoning comes back whole, as a reasoning item)",
                "reasoning",
            )
        return self


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Strict types as the chat request. ``job_id`` /
    ``is_last_step`` are this server's agent extras (the openai client's ``extra_body``);
    without them the job is ``prompt_cache_key``, else the chain's (``serving_responses``).
    ``max_tool_calls`` bounds the calls to ``mcp`` tools this server runs
    (``responses_mcp.py``)."""

    FIELD_NAMES: ClassVar[dict[str, str]] = {  # chat request field -> this request's
        "messages": "input",
        "prompt": "input",
        "max_completion_tokens": "max_output_tokens",
        "max_tokens": "max_output_tokens",
        "response_format": "text",
    }

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: StrictStr | None = None
    conversation: StrictStr | dict[str, Any] | None = None  # an id or {"id"}: conversations.py
    store: bool | None = None
    stream: bool = False
    background: bool | None = None  # true: run as a task, answered at once (needs store)
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None  # validated by the chat request
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    job_id: StrictStr | None = None
    is_last_step: StrictBool | None = None
    priority: int = 0
    # vLLM's: a stable identity shared by related requests; names the job when neither
    # job_id nor prompt_cache_key does (job_identity.py).
    session_id: StrictStr | None = Field(default=None, min_length=1)
    reasoning: ReasoningParams | None = None
    # OpenAI's: "auto" drops the context's oldest items when the turn does not fit the
    # context window (serving_responses.py's ``_fitted``); "disabled" (None): a 400.
    truncation: Literal["auto", "disabled"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _bound(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _check_nesting(data)
            check_count(data, "input", "items")
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> ResponsesRequest:
        refuse_extras(self.model_extra or {}, UNSUPPORTED, "Responses")
        if self.background and not self.stored:
            raise VLLMValidationError(
                "background=true needs store=true: a background response is retrieved "
                "from the store",
                "background",
            )
        if self.metadata is not None:
            _check_metadata(self.metadata)
        if self.conversation_id is not None and self.previous_response_id is not None:
            raise VLLMValidationError(
                "conversation and previous_response_id cannot be used together", "conversation"
            )
        return self

    @property
    def conversation_id(self) -> str | None:
        """``conversation``'s id; ``VLLMValidationError`` naming it if malformed."""
        conv = self.conversation
        conv = conv.get("id") if isinstance(conv, dict) and set(conv) == {"id"} else conv
        if conv is not None and not (isinstance(conv, str) and conv):
            raise VLLMValidationError(
                'conversation must be a conversation id or {"id": <conversation id>}',
                "conversation",
            )
        return conv

    @property
    def stored(self) -> bool:
        return self.store is not False  # OpenAI's default: stored


def refuse_extras(
    extra: dict[str, Any], unsupported: dict[str, Callable[[Any], bool]], kind: str
) -> None:
    """A request's fields beyond its model's (``extra``): a 400 naming the first of
    ``unsupported`` whose value asks for something; the unknown ones are ignored, as chat
    (and vLLM) does, and the log names them."""
    for name, harmless in unsupported.items():
        if name in extra and not harmless(extra[name]):
            raise VLLMValidationError(
                f"{name}={loggable(extra[name])} is not supported by this server", name
            )
    unknown = [k for k in extra if k not in unsupported]
    if unknown:
        shown = ", ".join(loggable(k, 40) for k in unknown[:MAX_LOGGED_FIELDS])
        logger.warning("%s request fields ignored (not recognised): %s", kind, shown)


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA:
        raise VLLMValidationError(
            f"metadata holds at most {MAX_METADATA} pairs, got {len(metadata)}", "metadata"
        )
    if any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise VLLMValidationError(
            "metadata keys are at most 64 characters, values at most 512", "metadata"
        )


# -- request -> chat ----------------------------------------------------------------------
def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; any other tool type is a 400 naming
    ``tools`` (hosted tools: web search, file search, ... are not served)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise VLLMValidationError(
                f"tools[{i}]: only function tools are supported, got type "
                f"{loggable(tool.get('type'))}",
                "tools",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        if fn.get("parameters") is None:
            fn.pop("parameters", None)
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """``"none" | "auto" | "required" | {"type": "function", "name"}`` in chat's form."""
    if choice is None or isinstance(choice, str):
        return choice  # plan_tool_calls names a bad string
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise VLLMValidationError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
        f"; got {loggable(choice)}",
        "tool_choice",
    )


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (text, json_object, json_schema);
    a ``verbosity`` other than medium is refused (nothing would honour it)."""
    if text is None:
        return None
    if set(text) - {"format", "verbosity"} or text.get("verbosity") not in (None, "medium"):
        raise VLLMValidationError(
            "text supports only format (and verbosity 'medium')", "text", code="unsupported"
        )
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise VLLMValidationError(
            'text.format.type must be "text", "json_object" or "json_schema"', "text"
        )
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


# -- items --------------------------------------------------------------------------------
def normalize_input(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's ``input`` as normalized items (a string is one user message);
    ``VLLMValidationError`` naming ``input`` for an item this server cannot take."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    return [_normalize_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _normalize_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in ROLES:
            raise VLLMValidationError(f"{where}.role must be one of {ROLES}", "input")
        parts = _text_parts(item.get("content"), f"{where}.content", images=role != "assistant")
        if role == "assistant":
            parts = [{**p, "type": "output_text", "annotations": []} for p in parts]
        return {
            "id": _str_or(item.get("id"), new_id("msg")),
            "type": "message",
            "role": role,
            "status": "completed",
            "content": parts,
        }
    if kind == "function_call":
        fields = {k: item.get(k) for k in ("call_id", "name", "arguments")}
        bad = [k for k, v in fields.items() if not isinstance(v, str)]
        if bad:
            raise VLLMValidationError(f"{where}.{bad[0]} must be a string", "input")
        item_id = _str_or(item.get("id"), new_id("fc"))
        return {"id": item_id, "type": kind, **fields, "status": "completed"}
    if kind == "reasoning":
        return _reasoning_input(item, where)
    if kind in ("mcp_list_tools", "mcp_call", "mcp_approval_request"):
        return _mcp_input(item, kind, where)
    if kind == "mcp_approval_response":
        if not isinstance(item.get("approval_request_id"), str):
            raise VLLMValidationError(f"{where}.approval_request_id must be a string", "input")
        if not isinstance(item.get("approve"), bool):
            raise VLLMValidationError(f"{where}.approve must be true or false", "input")
        reason = item.get("reason")
        return {"id": _str_or(item.get("id"), new_id("mcpa")), "type": kind,
                "approval_request_id": item["approval_request_id"], "approve": item["approve"],
                "reason": reason if isinstance(reason, str) else None}  # fmt: skip
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise VLLMValidationError(f"{where}.call_id must be a string", "input")
        output = item.get("output")
        if not isinstance(output, str):
            output = "".join(p["text"] for p in _text_parts(output, f"{where}.output"))
        return {
            "id": _str_or(item.get("id"), new_id("fco")),
            "type": kind,
            "call_id": item["call_id"],
            "output": output,
            "status": "completed",
        }
    raise VLLMValidationError(
        f"{where}: item type {loggable(kind)} is not supported (message, function_call, "
        "function_call_output, reasoning and the MCP items are)",
        "input",
    )


def _mcp_input(item: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """An mcp_list_tools or mcp_call item sent back (an earlier response's output): the
    listing is context only; a call becomes the assistant's tool call and its result."""
    if not isinstance(item.get("server_label"), str):
        raise VLLMValidationError(f"{where}.server_label must be a string", "input")
    if kind == "mcp_list_tools":
        if not isinstance(item.get("tools"), list):
            raise VLLMValidationError(f"{where}.tools must be a list", "input")
        return {"id": _str_or(item.get("id"), new_id("mcpl")), "type": kind,
                "server_label": item["server_label"], "tools": item["tools"],
                "error": item.get("error")}  # fmt: skip
    bad = [k for k in ("name", "arguments") if not isinstance(item.get(k), str)]
    output, error = item.get("output"), item.get("error")
    if bad or not (output is None or isinstance(output, str)):
        raise VLLMValidationError(f"{where}.{(bad or ['output'])[0]} must be a string", "input")
    if kind == "mcp_approval_request":
        return {"id": _str_or(item.get("id"), new_id("mcpr")), "type": kind,
                "server_label": item["server_label"], "name": item["name"],
                "arguments": item["arguments"]}  # fmt: skip
    asked = item.get("approval_request_id")
    return {
        "id": _str_or(item.get("id"), new_id("mcp")), "type": kind,
        "server_label": item["server_label"], "name": item["name"],
        "arguments": item["arguments"], "output": output, "error": error,
        "status": item.get("status") or "completed",
        "approval_request_id": asked if isinstance(asked, str) else None,
    }  # fmt: skip


def _reasoning_input(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A reasoning item sent back (this server's output, or a client's own): its
    ``reasoning_text`` parts, else its ``summary_text`` parts, become the reasoning of the
    assistant turn after it. Encrypted reasoning (OpenAI's) cannot be read here: refused."""
    if item.get("encrypted_content") is not None:
        raise VLLMValidationError(
            f"{where}.encrypted_content: encrypted reasoning cannot be read by this server",
            "input",
        )
    texts = {}
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        ok = isinstance(parts, list) and all(
            isinstance(p, dict) and p.get("type") == part_type and isinstance(p.get("text"), str)
            for p in parts
        )
        if not ok:
            raise VLLMValidationError(f"{where}.{key} must be a list of {part_type} parts", "input")
        texts[key] = [{"type": part_type, "text": p["text"]} for p in parts]
    return {
        "id": _str_or(item.get("id"), new_id("rs")),
        "type": "reasoning",
        "summary": texts["summary"],
        "content": texts["content"],
        "status": "completed",
    }


def _str_or(value: Any, default: str) -> str:
    return value if isinstance(value, str) and value else default


def _text_parts(content: Any, where: str, images: bool = False) -> list[dict[str, Any]]:
    """Text content parts ``{"type": "input_text", "text"}`` (cache breakpoints kept); a
    string is one part. With ``images`` (a user, system or developer message), image parts
    too: ``{"type": "input_image", "image_url", "detail"}``, loaded when the chat request
    runs (a model that takes none refuses them there). Files and audio are refused."""
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise VLLMValidationError(f"{where} must be a string or a list of parts", "input")
    parts = []
    for i, part in enumerate(content):
        part = part if isinstance(part, dict) else {}
        kind = part.get("type")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if images and kind == "input_image":
            new = _image_part(part, f"{where}[{i}]")
        elif kind not in (*TEXT_PARTS, "refusal") or not isinstance(text, str):
            wanted = "a text part (input_text, output_text)"
            if images:
                wanted += " or an image part (input_image)"
            raise VLLMValidationError(
                f"{where}[{i}] must be {wanted}, got {loggable(kind)}", "input"
            )
        else:
            new = {"type": "input_text", "text": text}
        if part.get("prompt_cache_breakpoint") is not None:
            new["prompt_cache_breakpoint"] = part["prompt_cache_breakpoint"]
        parts.append(new)
    return parts


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """An ``input_image`` part in its normalized form (OpenAI's: ``detail`` "auto" when
    not given). Only ``image_url`` (an http(s) or base64 data URL) is taken: this server
    stores no files for a ``file_id`` to name."""
    if part.get("file_id") is not None:
        raise VLLMValidationError(
            f"{where}.file_id: uploaded files are not supported: send the image as image_url",
            "input",
        )
    url, detail = part.get("image_url"), part.get("detail", "auto")
    if not isinstance(url, str) or not url:
        raise VLLMValidationError(f"{where}.image_url must be a URL string", "input")
    if detail not in IMAGE_DETAILS:
        raise VLLMValidationError(
            f"{where}.detail must be one of {', '.join(IMAGE_DETAILS)}, got {loggable(detail)}",
            "input",
        )
    return {"type": "input_image", "image_url": url, "detail": detail}


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized items as chat messages: consecutive function calls (and the assistant
    text before them) become one assistant message with ``tool_calls``; an output is a
    ``tool`` message naming its call's function. An output whose call is not among the
    items is a 400 naming ``input`` (as OpenAI)."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name
    reasoning: list[str] = []  # reasoning items not yet given to an assistant turn
    asked = {}  # approval requests by id: a call the model made, run only if approved
    for item in items:
        kind = item["type"]
        if kind == "mcp_list_tools":  # the tools come from the request's mcp tools
            continue
        if kind == "mcp_approval_request":
            asked[item["id"]] = item
            continue
        if kind == "mcp_approval_response":
            request = asked.get(item["approval_request_id"])
            if request is not None and not item["approve"]:  # approved: its mcp_call follows
                why = f": {item['reason']}" if item.get("reason") else ""
                refused = {**request, "output": None, "error": None,
                           "denied": f"The user did not approve this call{why}."}  # fmt: skip
                messages += _mcp_call_messages(refused, messages)
            continue
        if kind == "mcp_call":
            messages += _mcp_call_messages(item, messages)
            continue
        if kind == "reasoning":
            parts = item["content"] or item["summary"]
            reasoning.append("".join(p["text"] for p in parts))
            continue
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            parts = [{**_chat_part(p)} for p in item["content"]]
            messages.append({"role": role, "content": parts})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            name = names.get(item["call_id"])
            if name is None:
                raise VLLMValidationError(
                    f"No tool call found for function call output with call_id "
                    f"{loggable(item['call_id'])}",
                    "input",
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "name": name,
                    "content": item["output"],
                }
            )
        if reasoning:
            # Reasoning items are the reasoning (chat's field) of the assistant turn right
            # after them; before any other turn there is nothing for them to explain.
            last = messages[-1]
            if last["role"] == "assistant":
                last["reasoning"] = "\n".join([*filter(None, [last.get("reasoning")]), *reasoning])
            reasoning = []
    return messages


def _mcp_call_messages(item: dict[str, Any], messages: list[dict]) -> list[dict[str, Any]]:
    """An mcp_call item as chat: the assistant's tool call (on the assistant's text just
    before it, if any) and the tool's answer. Calls made together read as one after the
    other (the items do not say which were parallel)."""
    from vllm.entrypoints.openai.responses_mcp import call_text

    call = {"id": item["id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
    answer = {"role": "tool", "tool_call_id": item["id"], "name": item["name"],
              "content": item.get("denied") or call_text(item)}  # fmt: skip
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
        last["tool_calls"] = [call]
        return [answer]
    return [{"role": "assistant", "content": None, "tool_calls": [call]}, answer]


def _chat_part(part: dict[str, Any]) -> dict[str, Any]:
    if part["type"] == "input_image":
        chat = {
            "type": "image_url",
            "image_url": {"url": part["image_url"], "detail": part["detail"]},
        }
    else:
        chat = {"type": "text", "text": part["text"]}
    if "prompt_cache_breakpoint" in part:
        chat["prompt_cache_breakpoint"] = part["prompt_cache_breakpoint"]
    return chat


# -- chat output -> items -----------------------------------------------------------------
def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None) -> dict:
    return {
        "id": item_id or new_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "id": item_id or new_id("rs"),
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat ``message`` (``ToolPlan.message``) as Responses output items: its reasoning
    as a reasoning item, its text as a message item (each none when empty), then one
    ``function_call`` item per tool call."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(message["reasoning"], status))
    if message.get("content"):
        items.append(message_item(message["content"], status))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(call_item(call["id"], fn["name"], fn["arguments"]))
    return items


class InputItemsQuery(BaseModel):
    """``GET /v1/responses/{id}/input_items``'s query: OpenAI's pagination."""

    after: str | None = None
    limit: int = Field(default=20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"


class RetrieveQuery(BaseModel):
    """``GET /v1/responses/{id}``'s query: ``stream`` replays a background streamed
    response's events, from the one after sequence number ``starting_after``."""

    stream: bool = False
    starting_after: int | None = Field(default=None, ge=0)
