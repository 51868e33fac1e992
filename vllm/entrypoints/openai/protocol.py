"""OpenAI-compatible request/response models (pydantic) and the mapping to SamplingParams."""

from __future__ import annotations

import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RepetitionDetectionParams, RequestOutputKind, SamplingParams

logger = logging.getLogger("vllm.entrypoints.openai.protocol")

AGENT_FIELDS = ("job_id", "is_last_step")


def loggable(value: Any, limit: int = 80) -> str:
    """``value`` for a log line: repr-escaped (no raw newline or control character can forge
    a line) and at most ``limit`` characters of it."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} chars)"
    return repr(value)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """Every error this server answers, in OpenAI's shape."""

    error: ErrorInfo


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


# OpenAI / vLLM parameters this server does not implement, and the values that ask for
# nothing (so clients that send defaults still work). Anything else is a 400, never a
# silently ignored field.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v is None or v == 1,
    "suffix": _is_off,
    "response_format": lambda v: _is_off(v) or v == {"type": "text"},
    "functions": _is_off,
    "function_call": lambda v: _is_off(v) or v == "none",
    "tool_choice": lambda v: _is_off(v) or v == "none",
    "modalities": lambda v: _is_off(v) or v == ["text"],
    "audio": _is_off,
    "use_beam_search": _is_off,
    "guided_json": _is_off,
    "guided_regex": _is_off,
    "guided_choice": _is_off,
    "guided_grammar": _is_off,
    "structured_outputs": _is_off,
    "echo": _is_off,  # completions' and chat's (IMPLEMENTED)
    # vllm-router re-serializes every chat / completion body it forwards from its typed
    # request, adding these SGLang fields at their defaults (docs/router.md): at those
    # values they ask for nothing, so a routed request logs no unknown field. The
    # reasoning switches are served by chat (with --reasoning-parser); elsewhere no
    # reasoning is split off, so they are moot.
    "no_stop_trim": _is_off,
    "continue_final_message": _is_off,
    "return_hidden_states": _is_off,
    "separate_reasoning": lambda v: v is None or isinstance(v, bool),
    "stream_reasoning": lambda v: v is None or isinstance(v, bool),
    "include_reasoning": lambda v: v is None or isinstance(v, bool),
    # Chat's (with --reasoning-parser); completions split no reasoning off.
    "thinking_token_budget": lambda v: v is None or v == -1,
    # vLLM's, for what this engine does not have (an encoder cache connector, multimodal inputs,
    # watermarks, prompt embeddings, MoE routing traces, logprobs of chosen token ids, the
    # render routes' offsets): accepted at the values that ask for nothing.
    "logprob_token_ids": _is_off,
    "ec_transfer_params": _is_off,
    "mm_payload": lambda v: v is None or v == "tensors",
    "media_io_kwargs": _is_off,
    "mm_processor_kwargs": _is_off,
    "return_mm_kwargs": _is_off,
    "routed_experts_prompt_start": lambda v: v is None or v == 0,
    "watermarking": _is_off,
    "prompt_embeds": _is_off,
    "return_prompt_text": _is_off,
    "return_token_offsets": _is_off,
}
MAX_LOGGED_FIELDS = 8
# Most messages one chat request may hold. vLLM and OpenAI document no such bound (OpenAI
# caps ``tools`` and a message's ``tool_calls`` at 128); a long agent trajectory has
# hundreds of messages, so this only stops bodies built to exhaust the server.
MAX_CHAT_MESSAGES = 4096


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(s|m|h)")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


def parse_cache_ttl(value: Any, param: str) -> float:
    """Seconds of an OpenAI cache lifetime (``"30m"``, ``"12h"``; also ``"90s"``), else a
    ``VLLMValidationError`` naming ``param``."""
    match = _DURATION.fullmatch(value) if isinstance(value, str) else None
    seconds = float(match[1]) * _UNIT_S[match[2]] if match else 0.0
    if not (math.isfinite(seconds) and seconds > 0):
        raise VLLMValidationError(
            f"{param} must be a lifetime such as '30m', '12h' or '90s', got {value!r}", param
        )
    return seconds


class PromptCacheOptions(BaseModel):
    """OpenAI's ``prompt_cache_options``: ``ttl`` is a minimum lifetime, which becomes a
    floor on the turn's KV pin (``vllm_continuum.cache_hints``). This engine caches every
    full KV block of every prompt, so an ``implicit`` breakpoint, and any explicit one,
    is kept; ``explicit`` without any breakpoint asks for no caching at all, which is
    refused (a 400 naming the field) rather than ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: StrictStr | None = None

    @field_validator("ttl")
    @classmethod
    def _a_lifetime(cls, ttl: str | None) -> str | None:
        if ttl is not None:
            parse_cache_ttl(ttl, "prompt_cache_options.ttl")
        return ttl


def _take_cache_breakpoints(messages: Any) -> tuple[Any, list[float | None]]:
    """``messages`` without their parts' ``prompt_cache_breakpoint`` marks (copied, the
    input is left as it is), and each mark's ttl in seconds (None: the request's);
    ``VLLMValidationError`` naming ``messages`` if a mark is malformed."""
    if not isinstance(messages, list):
        return messages, []
    found: list[float | None] = []
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(p, dict) and "prompt_cache_breakpoint" in p for p in content
        ):
            parts = []
            for part in content:
                if isinstance(part, dict) and "prompt_cache_breakpoint" in part:
                    part = dict(part)
                    found.append(_breakpoint_ttl(part.pop("prompt_cache_breakpoint")))
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, found


def _breakpoint_ttl(mark: Any) -> float | None:
    if not isinstance(mark, dict) or mark.get("mode") != "explicit" or set(mark) - {"mode", "ttl"}:
        raise VLLMValidationError(
            "prompt_cache_breakpoint must be {'mode': 'explicit'} with an optional 'ttl', "
            f"got {loggable(mark)}",
            "messages",
        )
    ttl = mark.get("ttl")
    return None if ttl is None else parse_cache_ttl(ttl, "prompt_cache_breakpoint.ttl")


# Longest request_id a client may name its request by (vLLM sets no bound; the id is
# logged and echoed in every chunk).
MAX_REQUEST_ID = 256


class RepetitionDetection(BaseModel):
    """vLLM's ``repetition_detection`` (``SamplingParams.repetition_detection``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class StreamOptions(BaseModel):
    """OpenAI's ``include_usage`` (a last chunk with the usage) and vLLM's
    ``continuous_usage_stats`` (with it, every chunk carries the usage so far). OpenAI's
    ``include_obfuscation`` pads chunks against side channels: not done here, so only
    false is taken; any other key is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False

    @field_validator("include_obfuscation")
    @classmethod
    def _no_obfuscation(cls, value: bool) -> bool:
        if value:
            raise ValueError("include_obfuscation is not supported")
        return value


@dataclass(frozen=True)
class ImagePart:
    """An image content part of a chat message: the URL its image is loaded from
    (``data:``, ``http(s)://`` or ``file://``: ``vllm.multimodal.media.load_image``)."""

    url: str


_TEXT_PART = "{'type': 'text', 'text': <string>}"
_IMAGE_PART = "{'type': 'image_url', 'image_url': {'url': <string>}}"
# OpenAI's image ``detail`` values. vLLM validates them and then ignores them (it logs that
# 'image_url.detail' is not supported): the model's own processor sizes every image. So
# here: checked, then ignored.
IMAGE_DETAILS = ("auto", "low", "high")
# What /openapi.json says a message's content is: the text, or its parts (a field
# validator joins the texts and keeps the images aside, so the field itself holds text).
_CONTENT_SCHEMA = {
    "anyOf": [
        {"type": "string"},
        {
            "type": "array",
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        "required": ["type", "text"],
                    },
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": "image_url"},
                            "image_url": {
                                "type": "object",
                                "properties": {
                                    "url": {"type": "string"},
                                    "detail": {"enum": list(IMAGE_DETAILS)},
                                },
                                "required": ["url"],
                            },
                        },
                        "required": ["type", "image_url"],
                    },
                ]
            },
        },
        {"type": "null"},
    ],
    "title": "Content",
}


def _image_url(part: dict[str, Any], i: int) -> str:
    """The URL of an image part, in any of the forms vLLM's chat parser takes:
    ``{"type": "image_url", "image_url": {"url", "detail"?}}`` (OpenAI's), the same without
    ``type`` and with ``image_url`` a string or that dict (vLLM's shorthand, "supported by
    OpenAI API, although it is not documented"), and the Responses API's
    ``{"type": "input_image", "image_url": <string>, "detail"?}``. ``type: image_url``
    with a bare string is refused, as vLLM's parser refuses it."""
    kind, value = part.get("type"), part.get("image_url")
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise ValueError(f"part {i}: file_id is not supported: send the image as image_url")
        detail, url = part.get("detail"), value
        expected = "image_url must be a URL string"
    elif isinstance(value, dict) or kind == "image_url":
        value = value if isinstance(value, dict) else {}
        detail, url = value.get("detail"), value.get("url")
        expected = "image_url must be {'url': <string>}"
    else:  # no type: the shorthand's string
        detail, url = None, value
        expected = "image_url must be a URL string or {'url': <string>}"
    if not isinstance(url, str) or not url:
        given = part.get("image_url")
        got = f"an object whose url is {_json_kind(url)}" if isinstance(given, dict) else None
        raise ValueError(f"part {i}: {expected}, got {got or _json_kind(given)}")
    if detail is not None and detail not in IMAGE_DETAILS:
        raise ValueError(
            f"part {i}: detail must be one of {', '.join(IMAGE_DETAILS)}, got {loggable(detail)}"
        )
    return url


def _json_kind(value: Any) -> str:
    """What ``value`` is, in JSON's words (never the value: a URL may be megabytes)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "an empty string" if not value else "a string"
    names = {bool: "a boolean", int: "a number", float: "a number", dict: "an object"}
    return names.get(type(value), "an array" if isinstance(value, list) else "a value")


def _content_part(part: Any, i: int) -> str | ImagePart:
    """Part ``i`` of a message's content: its text, or an ``ImagePart``."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValueError(f"part {i}: text must be a string, got {part.get('text')!r}")
        return part["text"]
    if kind in ("image_url", "input_image") or (
        isinstance(part, dict) and kind is None and "image_url" in part
    ):
        return ImagePart(_image_url(part, i))
    got = f", got type {loggable(kind, 40)}" if kind is not None else ""
    raise ValueError(f"part {i} must be {_TEXT_PART} or {_IMAGE_PART}{got}")


def content_parts(content: list[Any]) -> list[str | ImagePart]:
    """A message's content parts in order: texts as strings, images as ``ImagePart``;
    a ``ValueError`` naming the first part that is neither."""
    return [_content_part(part, i) for i, part in enumerate(content)]


class ChatMessage(BaseModel):
    """One message; other keys (``name``, ``tool_calls``, ...) reach the chat template.

    ``content`` may be a list of text and image parts (``_image_url`` lists the image
    forms taken); any other part type is refused, not dropped. The text parts are joined
    into ``content``; a message with images also keeps its parts in order, for
    ``image_urls`` and ``for_template``.
    """

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: Annotated[StrictStr | None, WithJsonSchema(_CONTENT_SCHEMA)] = None
    # The content's parts in order (texts as str), when it holds an image; None: text only.
    _parts: tuple[str | ImagePart, ...] | None = PrivateAttr(default=None)

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content  # str / None, or a wrong type that the field type reports
        return "".join(p for p in content_parts(content) if isinstance(p, str))

    @model_validator(mode="wrap")
    @classmethod
    def _keep_image_parts(cls, data: Any, handler: Any) -> ChatMessage:
        message = handler(data)  # the content is checked (and its text joined) here
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            parts = content_parts(content)
            if any(isinstance(p, ImagePart) for p in parts):
                message._parts = tuple(parts)
        return message

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's images, in order (none for a text-only message)."""
        return [p.url for p in self._parts or () if isinstance(p, ImagePart)]

    def typed_parts(self) -> list[dict[str, str]]:
        """The content as typed parts, in order: ``{"type": "text", "text"}`` for text,
        ``{"type": "image"}`` for an image (what vLLM gives a template that reads parts:
        its "openai" content format)."""
        parts = self._parts if self._parts is not None else [self.content] if self.content else []
        return [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                for p in parts]  # fmt: skip

    def for_template(
        self, image_placeholder: str | None = None, typed_parts: bool = False
    ) -> dict[str, Any]:
        """The message as a chat template reads it: its content as text (a message with
        images gets ``image_placeholder``, the model's text for one image, for each;
        ``VLLMValidationError`` naming ``messages`` when it is None: the model takes no
        images), or with ``typed_parts`` as ``typed_parts()`` (the template writes the
        images' placeholders itself)."""
        if typed_parts:
            content: str | list[dict[str, str]] = self.typed_parts()
        else:
            content = self.content or ""
            if self._parts is not None:
                content = image_prompt_text(content, len(self.image_urls), image_placeholder)
        message = {**(self.model_extra or {}), "role": self.role, "content": content}
        # An assistant turn's reasoning, as a client sends it back (vLLM's ``reasoning``,
        # or its older ``reasoning_content``): templates read ``reasoning_content`` (Qwen3's
        # keeps the reasoning of the turns after the last user message), gpt-oss's
        # ``thinking`` (its analysis before a tool call).
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str):
            message["reasoning"] = message["reasoning_content"] = reasoning
            message.setdefault("thinking", reasoning)
        calls = message.get("tool_calls")
        if self.role == "assistant" and isinstance(calls, list):
            message["tool_calls"] = [_call_for_template(c) for c in calls]
        return message


NO_IMAGES = (
    "messages hold image parts, but this model takes no images: send text only, or serve "
    "a model that takes images"
)


def image_prompt_text(text: str, num_images: int, placeholder: str | None) -> str:
    """A message's text with its images' placeholders, as vLLM writes it for a chat
    template that takes text content (``_get_full_multimodal_text_prompt``): placeholders
    the text already holds stand for images in their order; one more placeholder for each
    image left goes before the text, each on its own line. More placeholders in the text
    than images: ``VLLMValidationError`` naming ``messages``."""
    if placeholder is None:
        raise VLLMValidationError(NO_IMAGES, "messages")
    missing = num_images - text.count(placeholder)
    if missing < 0:
        raise VLLMValidationError(
            f"a message's text holds {text.count(placeholder)} image placeholders "
            f"({placeholder!r}) for {num_images} images: at most one per image",
            "messages",
        )
    return "\n".join([placeholder] * missing + ([text] if text else []))


def _call_for_template(call: Any) -> Any:
    """An assistant tool call with its ``arguments`` as a dict, as vLLM gives templates
    (transformers' convention: Qwen3-Coder's template iterates over them, Llama 3.1's
    serializes them with ``tojson``); OpenAI clients send a JSON string. Arguments that
    are not a JSON object become ``{}`` with a warning, as in vLLM: the turn is history,
    and refusing it would fail every later turn of the conversation."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    text = fn["arguments"]
    try:
        args = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        args = None
    if not isinstance(args, dict):
        logger.warning(
            "Tool call %s has arguments that are not a JSON object (%d chars): given to the "
            "template as {}",
            loggable(fn.get("name"), 40),
            len(text),
        )
        args = {}
    return {**call, "function": {**fn, "arguments": args}}


_MESSAGES = TypeAdapter(list[ChatMessage])


def parse_messages(messages: Any, image_placeholder: str | None = None) -> list[dict[str, Any]]:
    """Validated messages as chat-template dicts (for callers outside a request model,
    such as the offline ``LLM.chat``); ``VLLMValidationError`` naming ``messages``.
    ``image_placeholder``: the model's text for an image (None: messages with images
    are refused); the images themselves are ``validate_messages``' ``image_urls``."""
    return [m.for_template(image_placeholder) for m in validate_messages(messages)]


def validate_messages(messages: Any) -> list[ChatMessage]:
    """``messages`` validated as a chat request's are; ``VLLMValidationError`` naming
    ``messages``."""
    try:
        parsed = _MESSAGES.validate_python(messages)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise VLLMValidationError(f"messages.{where}: {first['msg']}", "messages") from e
    if not parsed:
        raise VLLMValidationError("messages must not be empty", "messages")
    return parsed


def check_count(data: Any, field: str, noun: str) -> None:
    """``VLLMValidationError`` naming ``field`` if ``data[field]`` (a raw request body's
    list) holds more than MAX_CHAT_MESSAGES ``noun``; counted before any is validated."""
    items = data.get(field) if isinstance(data, dict) else None
    if isinstance(items, list) and len(items) > MAX_CHAT_MESSAGES:
        raise VLLMValidationError(
            f"{field} must hold at most {MAX_CHAT_MESSAGES} {noun}, got {len(items)}", field
        )


# Tool schemas nest a dozen levels; hundreds only serve to blow the stack of whatever
# recurses into the value later (deepcopy, pickle to the engine, the chat template).
MAX_NESTING = 64


def _check_nesting(data: dict[str, Any]) -> None:
    """``VLLMValidationError`` naming the top-level field nested deeper than MAX_NESTING."""
    for key, value in data.items():
        stack = [(value, 1)]
        while stack:  # iterative: the check itself must not recurse
            item, depth = stack.pop()
            if depth > MAX_NESTING:
                raise VLLMValidationError(
                    f"{key} is nested more than {MAX_NESTING} levels deep", str(key)
                )
            children = item.values() if isinstance(item, dict) else item
            if isinstance(item, dict | list):
                stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


# What a request's unset sampling parameters are when the model sets no default: vLLM's.
VLLM_SAMPLING_DEFAULTS: dict[str, Any] = {
    name: getattr(SamplingParams(), name)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
}


# Template variables the chat request sets itself: chat_template_kwargs may not.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt", "chat_template",
     "tokenize", "return_dict", "continue_final_message"}
)  # fmt: skip


class _SamplingFields(BaseModel):
    """Fields shared by chat and completion requests (OpenAI + vLLM extras).

    Strict types, as OpenAI's API: ``"0.5"`` is not a temperature, ``"yes"`` not a
    ``stream`` flag, ``true`` or ``1.0`` not a token id (a 400 naming the field, never a
    silent coercion); an integer is still a valid float.

    Agent metadata may come at the top level (the openai client's ``extra_body``), in
    ``vllm_xargs``, or in a nested ``"extra_body": {...}`` (raw HTTP clients). Before field
    validation all three are folded into the top-level ``job_id`` / ``is_last_step`` (the
    top level wins), so each is type-checked once, by its field type.
    """

    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset()  # names of UNSUPPORTED served here

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    # vLLM's disaggregated prefill (--kv-transfer-config): a router's instructions to the
    # engine, passed on in SamplingParams.extra_args; the engine checks them.
    kv_transfer_params: dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # OpenAI's: token id (a string, as JSON keys are) -> bias added to its logit, clamped to
    # [-100, 100] as vLLM does. vLLM's extra: the only tokens that may be sampled.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # vLLM's: words the output may not contain
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens
    # vLLM's: salts this request's prefix-cache hashes (requests share cached blocks only
    # with requests of the same salt: other tenants cannot probe for a cached prompt).
    cache_salt: StrictStr | None = Field(default=None, min_length=1)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    # vLLM's extra: per prompt token, its logprob and the top-n (the first token: None).
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # vLLM's: the tokenizer adds its special tokens (BOS) to the prompt; None: the
    # endpoint's default (completions: true; chat: false, the template wrote them).
    add_special_tokens: bool | None = None
    # vLLM's. Kept for the slow tokenizers that put spaces between special tokens: the
    # fast tokenizers this engine loads put none either way (vLLM's fast path ignores it).
    spaces_between_special_tokens: bool = True
    # vLLM's: which end truncate_prompt_tokens cuts (None, "left": keep the last tokens).
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's: logprobs' tokens as "token_id:<id>" (tokens JSON cannot hold, e.g. partial
    # UTF-8); the server's --return-tokens-as-token-ids turns it on for every request.
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: stop once the output ends in an n-gram repeated min_count times
    # (finish_reason "repetition").
    repetition_detection: RepetitionDetection | None = None
    # vLLM's: the prompt's and the output's token ids in the response (agent tracing, RL).
    return_token_ids: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: new tokens gathered into each streamed chunk (the first and the last are sent
    # at once); raises the server's --stream-interval for this request, never lowers it.
    # A non-streaming request has one response whatever it is.
    stream_interval: int | None = Field(default=None, ge=1)
    # vLLM's beam search (chat and completions, beam_search.py): n beams; length_penalty
    # divides a beam's cumulative logprob by its length to that power.
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
    user: str | None = None
    priority: int = 0  # vLLM's X-Vllm-Priority header, when sent, replaces it
    # vLLM's: the response's id is chatcmpl-<request_id> (cmpl- on completions); an
    # X-Request-Id header wins (job_identity.read_headers). serving_engine.request_ids.
    request_id: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_REQUEST_ID)
    # vLLM's: a stable identity shared by related requests (a conversation, an agent
    # session): names the job when neither job_id nor prompt_cache_key does.
    session_id: StrictStr | None = Field(default=None, min_length=1)
    job_id: StrictStr | None = None
    is_last_step: StrictBool | None = None
    # OpenAI's own prompt-caching fields: the key names the job when no job_id is given;
    # the options and retention become pin hints (vllm_continuum/cache_hints.py).
    prompt_cache_key: StrictStr | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    vllm_xargs: dict[str, Any] | None = None  # without job_id / is_last_step once validated
    extra_body: dict[str, Any] | None = None  # emptied by _normalize

    def stream_usage(self, force: bool = False) -> tuple[bool, bool]:
        """Whether a stream ends with a usage chunk (``force``: whatever it asked, the
        server's --enable-force-include-usage), and whether every chunk carries the usage
        so far (``continuous_usage_stats`` counts only with ``include_usage``, as in
        vLLM)."""
        options = self.stream_options
        include = force or (options is not None and options.include_usage)
        return include, include and options is not None and options.continuous_usage_stats

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if isinstance(data.get("extra_body"), dict):
            # Its fields, as the openai client would have merged them; top-level ones win.
            rest = {k: v for k, v in data.items() if k != "extra_body"}
            data = {**data["extra_body"], **rest}
        _check_nesting(data)
        xargs = data.get("vllm_xargs")
        if isinstance(xargs, dict) and any(name in xargs for name in AGENT_FIELDS):
            data = dict(data)
            data["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in AGENT_FIELDS}
            for name in AGENT_FIELDS:
                if data.get(name) is None and name in xargs:
                    data[name] = xargs[name]
        return data

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingFields:
        values = {**(self.model_extra or {}), **self.__dict__}
        for name, harmless in UNSUPPORTED.items():
            if name in self.IMPLEMENTED:
                continue
            if name in values and not harmless(values[name]):
                raise VLLMValidationError(f"{name} is not supported yet", name)
        unknown = [k for k in self.model_extra or {} if k not in UNSUPPORTED]
        if unknown:
            # As vLLM does: unknown fields are ignored, and the log says so.
            shown = ", ".join(loggable(k, 40) for k in unknown[:MAX_LOGGED_FIELDS])
            more = f" and {len(unknown) - MAX_LOGGED_FIELDS} more" if len(unknown) > 8 else ""
            logger.warning("Request fields ignored (not recognised): %s%s", shown, more)
        return self

    @model_validator(mode="after")
    def _prefill_answers_once(self) -> _SamplingFields:
        transfer = self.kv_transfer_params or {}
        if transfer and self.n != 1:
            # One prefill's blocks are held for one fetch (as vLLM's connectors do).
            raise VLLMValidationError("kv_transfer_params needs n 1", "kv_transfer_params")
        if transfer.get("do_remote_decode") is True and self.stream:
            # Its answer (where the KV is held) comes with the whole response, as vLLM's
            # routers ask for it: a stream would leave the blocks held until they expire.
            raise VLLMValidationError(
                "kv_transfer_params.do_remote_decode needs stream false (the KV's location "
                "comes with the whole response)",
                "kv_transfer_params",
            )
        return self

    @model_validator(mode="after")
    def _length_penalty_needs_beams(self) -> _SamplingFields:
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise VLLMValidationError(
                "length_penalty only applies with use_beam_search", "length_penalty"
            )
        return self

    @model_validator(mode="after")
    def _prompt_cache_key_names_the_job(self) -> _SamplingFields:
        if self.prompt_cache_key == "":
            raise VLLMValidationError("prompt_cache_key must not be empty", "prompt_cache_key")
        if self.job_id is None:  # an explicit job_id wins
            self.job_id = self.prompt_cache_key
        return self

    def cache_breakpoint_ttls(self) -> list[float | None]:
        """The prompt's explicit cache breakpoints (chat only): their ttls, None to inherit."""
        return []

    def cache_ttl_s(self) -> float | None:
        """The floor on this turn's pin: the longest lifetime the request asks for."""
        options = self.prompt_cache_options
        request_ttl = None
        if options is not None and options.ttl is not None:
            request_ttl = parse_cache_ttl(options.ttl, "prompt_cache_options.ttl")
        ttls = [request_ttl, *(t or request_ttl for t in self.cache_breakpoint_ttls())]
        return max((t for t in ttls if t is not None), default=None)

    def extra_args(self) -> dict[str, Any] | None:
        """``SamplingParams.extra_args``: ``vllm_xargs`` plus the agent metadata and the
        prompt-caching hints."""
        args = dict(self.vllm_xargs or {})
        if self.job_id is not None:
            args["job_id"] = self.job_id
        if self.is_last_step is not None:
            args["is_last_step"] = self.is_last_step
        ttl = self.cache_ttl_s()
        if ttl is not None:
            args["cache_ttl_s"] = ttl
        if self.prompt_cache_retention is not None:
            args["cache_retention"] = self.prompt_cache_retention
        if self.kv_transfer_params:
            args["kv_transfer_params"] = self.kv_transfer_params
        return args or None

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise VLLMValidationError(
                    f"logit_bias keys must be token ids, got {key!r}", "logit_bias", key
                )
            if not math.isfinite(value):
                raise VLLMValidationError(
                    f"logit_bias values must be finite numbers, got {value!r}", "logit_bias"
                )
            bias[int(key)] = min(100.0, max(-100.0, float(value)))
        return bias

    def _repetition_detection(self) -> RepetitionDetectionParams | None:
        detection = self.repetition_detection
        if detection is None or detection.max_pattern_size == 0:
            return None  # off
        return RepetitionDetectionParams(**detection.model_dump())

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        stream: bool,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """``VLLMValidationError`` naming the field if a value is out of range. A sampling
        parameter the request leaves unset takes ``defaults``' (the model's generation
        config: ``default_sampling_params``), else vLLM's own."""
        if self.prompt_logprobs is not None and stream:
            raise VLLMValidationError(
                "prompt_logprobs are not available when stream=True", "prompt_logprobs"
            )
        base = {**VLLM_SAMPLING_DEFAULTS, **(defaults or {})}

        def unset_or(name: str) -> Any:
            value = getattr(self, name)
            return base[name] if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=unset_or("temperature"),
            top_p=unset_or("top_p"),
            top_k=unset_or("top_k"),
            min_p=unset_or("min_p"),
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=unset_or("repetition_penalty"),
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            truncation_side=self.truncation_side or "left",
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            repetition_detection=self._repetition_detection(),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            stream_interval=self.stream_interval,
            extra_args=self.extra_args(),
        )


class ChatCompletionRequest(_SamplingFields):
    """``messages`` holds at most MAX_CHAT_MESSAGES, counted before any is validated;
    ``top_logprobs`` needs ``logprobs: true`` (as OpenAI)."""

    # Implemented on this endpoint (tool_calling.py), though in UNSUPPORTED for the other.
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {
            "tool_choice",
            "response_format",
            "structured_outputs",
            "include_reasoning",
            "separate_reasoning",
            "stream_reasoning",
            "thinking_token_budget",
            "continue_final_message",
            "echo",
            "use_beam_search",
            "mm_processor_kwargs",
        }
    )
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Validated by tool_calling.plan_tool_calls (400s naming the field).
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's extra: {"json": ...}, ...
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the last message (an assistant turn the client began),
    # which the model goes on with; needs add_generation_prompt: false.
    continue_final_message: bool = False
    # vLLM's: a reply leads with the last message's content when that is the assistant's
    # (with continue_final_message: the whole assistant turn, as given plus as generated).
    echo: bool = False
    chat_template: str | None = None
    # vLLM's: more variables for the chat template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the image processor's arguments for this request's images, over the
    # server's --mm-processor-kwargs (multimodal.processing: which keys, which values).
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for a template that renders them (RAG; e.g. {"title", "text"}
    # each); a template that does not ignores them.
    documents: list[dict[str, str]] | None = None
    # OpenAI's, as vLLM serves it: the template variable reasoning_effort, and
    # enable_thinking (false for "none") unless chat_template_kwargs sets it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    # With --reasoning-parser (None: true). vLLM's include_reasoning: false drops the
    # reasoning from the response; SGLang's separate_reasoning: false leaves it in the
    # content, stream_reasoning: false streams it in one piece once it is over.
    include_reasoning: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    # vLLM's: at most this many output tokens of reasoning, then its end tag is forced
    # (with --reasoning-parser); -1 or None: no budget.
    thinking_token_budget: int | None = Field(default=None, ge=-1)
    # Filled from the messages' prompt_cache_breakpoint marks by _bound_messages (a value
    # sent under this name is replaced); never serialized.
    cache_breakpoints: list[float | None] = Field(default_factory=list, exclude=True)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_template_variables(cls, kwargs: dict[str, Any] | None) -> Any:
        reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise VLLMValidationError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: they are request "
                "fields of their own",
                "chat_template_kwargs",
            )
        return kwargs

    @model_validator(mode="before")
    @classmethod
    def _bound_messages(cls, data: Any) -> Any:
        # Runs before the parent's validators and the field's: 250k messages are refused
        # without building 250k models (seconds on the event loop, a GiB of memory).
        check_count(data, "messages", "messages")
        if isinstance(data, dict):
            messages, marks = _take_cache_breakpoints(data.get("messages"))
            data = {**data, "messages": messages, "cache_breakpoints": marks}
        return data

    def cache_breakpoint_ttls(self) -> list[float | None]:
        return self.cache_breakpoints

    @model_validator(mode="after")
    def _explicit_mode_needs_a_breakpoint(self) -> ChatCompletionRequest:
        options = self.prompt_cache_options
        if options is not None and options.mode == "explicit" and not self.cache_breakpoints:
            raise VLLMValidationError(_NO_CACHING, "prompt_cache_options.mode")
        return self

    @model_validator(mode="after")
    def _continue_or_add_a_turn(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise VLLMValidationError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the last message",
                "continue_final_message",
            )
        return self

    @property
    def has_images(self) -> bool:
        """Whether any message holds an image part."""
        return any(m.image_urls for m in self.messages)

    def echoed_text(self, role: str = "assistant") -> str:
        """What ``echo`` puts before each choice's content: the last message's, when it
        has the reply's ``role`` (the reply continues or follows it; "" otherwise)."""
        last = self.messages[-1]
        return (last.content or "") if self.echo and last.role == role else ""

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise VLLMValidationError(
                "logprobs must be set to true if top_logprobs is used", "top_logprobs"
            )
        return self


_NO_CACHING = (
    "prompt_cache_options.mode 'explicit' without a prompt_cache_breakpoint asks for no "
    "prompt caching, which this server does not offer: use mode 'implicit' or mark a "
    "content part with a breakpoint"
)


class CompletionRequest(_SamplingFields):
    IMPLEMENTED: ClassVar[frozenset[str]] = frozenset(
        {"echo", "response_format", "structured_outputs", "use_beam_search", "prompt_embeds"}
    )

    # None (or "" beside prompt_embeds): no text prompt.
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's (--enable-prompt-embeds): base64 of a torch.save'd (num_tokens, hidden_size)
    # tensor, or a list of them; each is one prompt, before those of ``prompt``.
    prompt_embeds: str | list[str] | None = None
    logprobs: int | None = None
    echo: bool = False
    # Guided decoding, as on chat (vLLM takes both on completions too).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"json": ...}, ...

    @model_validator(mode="after")
    def _explicit_mode_needs_a_breakpoint(self) -> CompletionRequest:
        options = self.prompt_cache_options
        if options is not None and options.mode == "explicit":  # a prompt has no parts
            raise VLLMValidationError(_NO_CACHING, "prompt_cache_options.mode")
        return self

    @model_validator(mode="after")
    def _a_prompt_or_embeds(self) -> CompletionRequest:
        if self.prompt is None and not self.prompt_embeds:  # as vLLM's
            raise VLLMValidationError(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids_are_ints(cls, prompt: Any) -> Any:
        # The union's own error would blame its first branch ("should be a valid string").
        items = prompt if isinstance(prompt, list) else []
        ids = [t for p in items for t in (p if isinstance(p, list) else [p])]
        bad = next((t for t in ids if not isinstance(t, str) and type(t) is not int), None)
        if bad is not None:
            raise ValueError(f"token ids must be integers, got {bad!r}")
        return prompt


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "vllm-continuum"
    root: str | None = None  # a LoRA adapter's folder (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str | None = None
    lora_path: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; ``lora_int_id`` is accepted and unused:
    the name identifies the adapter)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str | None = None
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's body, and vLLM's ``add_special_tokens`` and
    ``priority``). ``dimensions`` is refused (this engine's embeddings are the model's
    whole hidden state); an unknown field is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True
    priority: int = 0

    def prompts(self) -> list[str | list[int]]:
        """The inputs, one per embedding: a string, token ids, or a list of either."""
        items = self.input
        if isinstance(items, str):
            return [items]
        if items and all(isinstance(t, int) for t in items):
            return [items]
        return list(items)


def input_prompts(items: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A pooling request's ``input``, one prompt each: a string, token ids, or a list of
    either."""
    if isinstance(items, str):
        return [items]
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return list(items)


class _PoolingInputs(BaseModel):
    """The text inputs of vLLM's pooling routes (/classify, /pooling): a string, token
    ids, or a list of either, one result each."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    user: str | None = None
    add_special_tokens: bool = True
    priority: int = 0
    use_activation: bool | None = None

    def prompts(self) -> list[str | list[int]]:
        return input_prompts(self.input)


class ClassificationRequest(_PoolingInputs):
    """POST /classify (vLLM's body for text inputs): ``use_activation`` false returns the
    score head's logits instead of probabilities. An unknown field is a 400 (vLLM's
    removed ``normalize`` among them)."""


class PoolingRequest(_PoolingInputs):
    """POST /pooling (vLLM's generic pooling body for text inputs): the model's own task
    (``task``, when given, must be it: embed or classify). ``dimensions`` is refused, as
    on /v1/embeddings."""

    task: Literal["embed", "classify"] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
