"""The tool parser interface and the registry that feeds ``--tool-call-parser``."""

from __future__ import annotations

import json
import logging
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from vllm.entrypoints.openai.tool_parsers.json_scan import Malformed, scan_object
from vllm.utils.registry import ClassRegistry

logger = logging.getLogger("vllm.entrypoints.openai.tool_parsers")

_REGISTRY: ClassRegistry[type[ToolParser]] = ClassRegistry("tool parser", "tool_call_parser")
# Class decorator: the parser is offered to ``--tool-call-parser`` under the given names.
register_tool_parser = _REGISTRY.register

# The arguments of a tool whose schema a structural tag does not enforce: any JSON object
# (a strict schema of an object that says nothing would allow only {}).
ANY_OBJECT = {"type": "object", "additionalProperties": True}
EMPTY: Mapping[str, int] = MappingProxyType({})  # no special tokens


def marker_token(marker: str, special_tokens: Mapping[str, int]) -> str | None:
    """The Lark reference of ``marker`` as the tokenizer's special token (its name where
    shaped ``<...>``, else its id: ``<[id]>``), or None when it is no special token."""
    if marker not in special_tokens:
        return None
    if marker.startswith("<") and marker.endswith(">"):
        return marker
    return f"<[{special_tokens[marker]}]>"


def marker_trigger(marker: str, special_tokens: Mapping[str, int]) -> str:
    """A structural tag's trigger for a call that opens with ``marker``: the special
    token, else its text (less a closing ``>``: a trigger shaped ``<...>`` is read as a
    special token's name)."""
    token = marker_token(marker, special_tokens)
    if token is not None:
        return token
    return marker[:-1] if marker.startswith("<") and marker.endswith(">") else marker


def marker_begin(marker: str, special_tokens: Mapping[str, int]) -> str:
    """The ``begin`` of a structure that ``marker_trigger`` opens (the structure's Lark
    follows it): the special token, else the marker's text."""
    return marker_token(marker, special_tokens) or marker


def marker_lark(marker: str, special_tokens: Mapping[str, int]) -> str:
    """``marker`` as a Lark expression: the special token, else its text."""
    return marker_token(marker, special_tokens) or json.dumps(marker)


def json_lark(schema: dict) -> str:
    """The Lark of JSON valid against ``schema`` made strict (``grammar.json_lark``),
    imported on use: the structured-output package loads torch, which the CLI's parser
    (that imports the tool parsers) must not."""
    from vllm.v1.structured_output.grammar import json_lark as lark

    return lark(schema)


def text_until(name: str, marker: str, special_tokens: Mapping[str, int]) -> tuple[str, str]:
    """Free text ended by ``marker`` (a value in a tagged format): the Lark line of the
    terminal ``name`` and the expression of the text with its marker. Text cannot hold a
    special token, so there the marker simply follows; a marker of text ends one lexeme
    of "anything ending with the marker, with none before" (``text_ending_with``)."""
    from vllm.v1.structured_output.grammar import text_ending_with

    token = marker_token(marker, special_tokens)
    if token is not None:
        return f"{name}: /(.|\\n)*/", f"{name} {token}"
    return text_ending_with(name, marker), name


tool_parser_names = _REGISTRY.names


def tool_parser_class(name: str) -> type[ToolParser]:
    return _REGISTRY.get(name)


def get_tool_parser(name: str, functions: Mapping[str, dict] | None = None) -> ToolParser:
    """The parser ``name`` for one request; ``functions``: its tools' definitions by name
    (``{"name", "description", "parameters"}``), for formats whose arguments are typed
    by the schema (Qwen3-Coder's XML)."""
    return _REGISTRY.get(name)(functions)


@dataclass
class ParsedToolCall:
    """One call in the output. While streaming, ``name`` is None until its string is
    complete, and ``arguments`` is the raw JSON text so far: each version is a prefix of
    the next, and of the final one. ``id``: the id the model wrote for it (Kimi-K2's
    ``functions.NAME:IDX``), which the response keeps; None: the server makes one."""

    name: str | None
    arguments: str
    complete: bool
    id: str | None = None


@dataclass
class ExtractedToolCalls:
    content: str | None
    calls: list[ParsedToolCall]


class ToolParser(ABC):
    """Splits a model's output into content and tool calls (stateless: it re-reads the
    whole output each time). Subclasses implement ``extract_tool_calls``; callers use
    ``extract``, which never raises."""

    # The requests it reads keep special tokens in their text (its markers are special
    # tokens, as Mistral's [TOOL_CALLS]).
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, functions: Mapping[str, dict] | None = None) -> None:
        self.functions: Mapping[str, dict] = functions or {}

    @staticmethod
    def new_call_id() -> str:
        """The id of a call in a response (the model's chat template may constrain the
        ids sent back to it: Mistral's take 9 alphanumeric characters)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def extract(self, text: str, final: bool) -> ExtractedToolCalls:
        """``extract_tool_calls``, except that a parser that fails (a bug, or output nested
        too deep for ``json``: ``RecursionError``) returns the text as content, as vLLM
        does: the model's output must never turn into a server error. Not ``final``, the
        fallback holds everything back (empty content, no call), which keeps the stream's
        "only grows" contract: the final call returns the text."""
        try:
            return self.extract_tool_calls(text, final)
        except Exception as e:
            logger.warning(
                "%s failed on %d characters of output (%s: %.200s); returned as content",
                type(self).__name__,
                len(text),
                type(e).__name__,
                e,
            )
            if final:
                return ExtractedToolCalls(text.strip() or None, [])
            return ExtractedToolCalls("", [])

    @classmethod
    def structural_tag(
        cls,
        schemas: Mapping[str, dict | None],
        special_tokens: Mapping[str, int] = EMPTY,
        single: bool = False,
    ) -> dict | None:
        """The structural tag (vLLM's ``{"structures", "triggers"}``) that holds this
        format's calls of the tools ``schemas`` names to their form once a call opens:
        the call's envelope, one of these names, and arguments valid against the schema
        (None: any JSON object). The text around calls stays free. ``special_tokens``:
        the tokenizer's, text -> id (a marker that is one is matched as the token, else
        as text: ``marker_trigger``, ``marker_lark``; free text cannot hold a special
        token). ``single`` (``parallel_tool_calls`` false): the output ends after the
        first structure (``structural_tag_grammar``'s ``at_most_one``), so a format whose
        calls sit in one section holds that section to one call.
        None: the format has no such tag here (``tool_choice`` "auto" then stays
        unconstrained, as in vLLM)."""
        return None

    @classmethod
    def has_structural_tag(cls) -> bool:
        """Whether the format has a structural tag here at all (Mistral's then still
        depends on the tokenizer: v11's ``[ARGS]`` token)."""
        return cls.structural_tag.__func__ is not ToolParser.structural_tag.__func__

    def plain_content(self, text: str) -> str:
        """The content of a whole output in which no call was found (default: the text
        as the model wrote it; a format whose markers frame every answer drops them)."""
        return text

    @abstractmethod
    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        """``final``: the whole output. Every call returned is then complete and valid
        (a string name, an object as arguments); text that looks like a call but is not
        one (malformed JSON, cut off by max_tokens) is returned as content.

        Not ``final`` (streaming), the text may stop at any character: ``content`` is only
        what is certainly content (a possible start of a call is held back), and calls
        are reported as far as they go. Both fields only grow as the text does."""


def held_back(text: str, *tags: str) -> int:
    """Length of the longest suffix of ``text`` that could begin one of ``tags`` (held
    back from streamed content until the next characters tell)."""
    for n in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-n:]) for tag in tags):
            return n
    return 0


def call_at(
    text: str, start: int, name_key: str = "name", args_key: str = "arguments"
) -> tuple[ParsedToolCall, int | None]:
    """The call object ``{"name": ..., "arguments"|"parameters": {...}}`` opening at
    ``text[start] == '{'``, and the end of the object (None while open). ``Malformed``
    if it is not JSON; a complete call is further checked by ``is_valid_call``. Other
    formats name the keys (Cohere's ``tool_name`` and ``parameters``)."""
    scan = scan_object(text, start)
    name = None
    if scan.complete(name_key):
        raw = json.loads(scan.raw(text, name_key))
        if not isinstance(raw, str):
            raise Malformed("name must be a string")
        name = raw
    key = args_key if args_key in scan.members else "parameters"
    args = scan.raw(text, key)
    if args is None:  # not there yet, or a call without arguments
        args = "{}" if scan.end is not None else ""
    return ParsedToolCall(name, args, scan.end is not None), scan.end


def is_valid_call(obj_text: str, name_key: str = "name", args_key: str = "arguments") -> bool:
    """Whether a complete call object is valid JSON with a name and object arguments."""
    try:
        obj = json.loads(obj_text)
    except (ValueError, RecursionError):  # RecursionError: nested past the stack
        return False
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str) or not obj[name_key]:
        return False
    args = obj.get(args_key, obj.get("parameters", {}))
    return isinstance(args, dict)
