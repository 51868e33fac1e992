"""Gemma 4's calls (vLLM's ``gemma4``)::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{temp:<|"|>C<|"|>}}<tool_call|>

Each call is its own ``<|tool_call>...<tool_call|>``; the text outside them is the
content. The arguments are Gemma's own notation of an object: ``key:value`` pairs apart
by commas, keys bare (or quoted as strings are), strings between ``<|"|>`` quotes,
objects in braces, arrays in brackets, and bare values: ``true``, ``false``, ``null`` and
numbers as JSON reads them, any other bare word kept as a string. A call cut after its
arguments' closing brace holds (the turn ended there, the model's end-of-turn token
possibly written in place of ``<tool_call|>``); a call cut inside them, or whose
arguments break the notation, is content.

The markers are special tokens of Gemma's vocabulary, so these requests keep special
tokens in their text. Streamed, a call appears once its name is complete, and its
``arguments`` JSON grows a whole top-level argument at a time, ``}`` when the call's
brace closes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.minimax_m2_tool_parser import finite_number
from vllm.entrypoints.openai.tool_parsers.tagged_calls import (
    CallOpen,
    NotACall,
    could_become,
    scan_tagged_calls,
    typed_arguments,
)

CALL_OPEN, CALL_CLOSE = "<|tool_call>", "<tool_call|>"
TURN_CLOSE = "<turn|>"
PREFIX = "call:"
QUOTE = '<|"|>'
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_SPACE = " \t\r\n"


class _Cut(Exception):
    """The text ends inside the value being read."""


@register_tool_parser("gemma4")
class Gemma4ToolParser(ToolParser):
    keeps_special_tokens = True

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        return scan_tagged_calls(text, final, (CALL_OPEN,), CALL_CLOSE, self._call)

    def _call(self, text: str, start: int, final: bool) -> tuple[ParsedToolCall, int]:
        pos = start + len(CALL_OPEN)
        rest = text[pos:]
        if not rest.startswith(PREFIX):
            if not final and could_become(rest, PREFIX):
                raise CallOpen(None)
            raise NotACall
        pos += len(PREFIX)
        name = _NAME.match(text, pos)
        if name is None or name.end() == len(text):
            if final or (name is None and pos < len(text)):
                raise NotACall
            raise CallOpen(None)  # the name may go on
        pos = name.end()
        if text[pos] != "{":
            raise NotACall
        args: list[tuple[str, Any]] = []
        pos += 1
        while True:
            pos = _skip(text, pos, _SPACE + ",")
            if pos >= len(text):
                if final:
                    raise NotACall  # cut inside the arguments
                raise CallOpen(self._parsed(name.group(), args, closed=False))
            if text[pos] == "}":
                break
            try:
                key, pos = _key(text, pos)
                value, pos = _value(text, pos, "}")
            except _Cut:
                if final:
                    raise NotACall from None
                raise CallOpen(self._parsed(name.group(), args, closed=False)) from None
            args.append((key, value))
        call = self._parsed(name.group(), args, closed=True)
        pos = _skip(text, pos + 1, _SPACE)
        for close in (CALL_CLOSE, TURN_CLOSE):
            if text.startswith(close, pos):
                return call, pos + len(close)
        if pos >= len(text) and final:
            return call, pos  # cut after the arguments: the turn ended there
        if not final and could_become(text[pos:], CALL_CLOSE, TURN_CLOSE):
            raise CallOpen(call)
        raise NotACall

    @staticmethod
    def _parsed(name: str, args: list[tuple[str, Any]], closed: bool) -> ParsedToolCall:
        return ParsedToolCall(name, typed_arguments(args, {}, lambda v, _: v, closed), closed)


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def _quoted(text: str, pos: int) -> tuple[str, int]:
    """The string whose opening quote is at ``pos`` and the position after it."""
    end = text.find(QUOTE, pos + len(QUOTE))
    if end < 0:
        raise _Cut
    return text[pos + len(QUOTE) : end], end + len(QUOTE)


def _key(text: str, pos: int) -> tuple[str, int]:
    """The key at ``pos`` and the position after its colon."""
    if text.startswith(QUOTE, pos):
        key, pos = _quoted(text, pos)
        pos = _skip(text, pos, _SPACE)
        if pos >= len(text):
            raise _Cut
        if text[pos] != ":":
            raise NotACall
        return key, pos + 1
    if QUOTE.startswith(text[pos:]):
        raise _Cut  # a quote, arriving
    colon = text.find(":", pos)
    if colon < 0:
        if any(c in text[pos:] for c in "{}[],<"):
            raise NotACall
        raise _Cut
    key = text[pos:colon].strip()
    if not key or any(c in key for c in "{}[],<"):
        raise NotACall
    return key, colon + 1


def _value(text: str, pos: int, closer: str) -> tuple[Any, int]:
    """The value at ``pos`` (inside a container that ``closer`` ends) and the position
    after it. ``_Cut`` when the text ends before it is whole, ``NotACall`` when it breaks
    the notation."""
    pos = _skip(text, pos, _SPACE)
    if pos >= len(text):
        raise _Cut
    if text.startswith(QUOTE, pos):
        return _quoted(text, pos)
    if QUOTE.startswith(text[pos:]):
        raise _Cut
    if text[pos] == "{":
        obj: dict[str, Any] = {}
        pos += 1
        while True:
            pos = _skip(text, pos, _SPACE + ",")
            if pos >= len(text):
                raise _Cut
            if text[pos] == "}":
                return obj, pos + 1
            key, pos = _key(text, pos)
            value, pos = _value(text, pos, "}")
            obj.setdefault(key, value)
    if text[pos] == "[":
        items: list[Any] = []
        pos += 1
        while True:
            pos = _skip(text, pos, _SPACE + ",")
            if pos >= len(text):
                raise _Cut
            if text[pos] == "]":
                return items, pos + 1
            value, pos = _value(text, pos, "]")
            items.append(value)
    end = pos
    while end < len(text) and text[end] not in ",}]":
        if text.startswith("<", end):
            raise NotACall  # a tag where a value should be
        end += 1
    if end >= len(text):
        raise _Cut  # a bare value may go on (42 -> 420)
    if text[end] != "," and text[end] != closer:
        raise NotACall
    raw = text[pos:end].strip()
    if not raw:
        raise NotACall
    return _bare(raw), end


def _bare(raw: str) -> Any:
    """A bare value: JSON's ``true``, ``false``, ``null`` or a finite number, else the
    text."""
    try:
        value = json.loads(raw, parse_float=finite_number, parse_constant=finite_number)
    except (ValueError, RecursionError):
        return raw
    return value if value is None or isinstance(value, (bool, int, float)) else raw
