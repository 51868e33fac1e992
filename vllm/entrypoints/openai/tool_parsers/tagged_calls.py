"""The scan shared by the parsers of tag-delimited calls (Qwen3-Coder's XML, GLM's
``<tool_call>name<arg_key>...``, MiniMax-M2's ``<invoke>`` blocks): content between calls,
each call (or block of calls) read by the parser's own reader, and the streaming rules of
``ToolParser.extract_tool_calls``; the JSON text of arguments given as typed key/value
pairs; and the reader of the calls with JSON arguments grouped in a section of special
tokens (DeepSeek, Kimi-K2)."""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ANY_OBJECT,
    EMPTY,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    held_back,
    json_lark,
    marker_begin,
    marker_lark,
    marker_trigger,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import Malformed, scan_object, skip_ws


class CallOpen(Exception):
    """The call goes on past the end of the text (streaming: wait for more); ``args[0]``:
    the call so far, or None before its name is complete (a reader of blocks: the list of
    the block's calls so far)."""


class NotACall(Exception):
    """The text at a call's start is not one (the user sees it as content)."""


def could_become(text: str, *tags: str) -> bool:
    """Whether ``text`` (the rest of the output) may still become one of ``tags``."""
    return any(tag.startswith(text) for tag in tags)


def _listed(calls: ParsedToolCall | list[ParsedToolCall] | None) -> list[ParsedToolCall]:
    if calls is None:
        return []
    return calls if isinstance(calls, list) else [calls]


def scan_tagged_calls(
    text: str,
    final: bool,
    starts: tuple[str, ...],
    close: str,
    read_call: Callable[[str, int, bool], tuple[ParsedToolCall | list[ParsedToolCall], int]],
) -> ExtractedToolCalls:
    """The calls in ``text`` and the content around them. A call begins at one of
    ``starts``; ``read_call(text, at, final)`` reads the one beginning at ``at`` and returns
    it with where it ends, or raises ``CallOpen`` (the text ends inside it: nothing after it
    is read yet) or ``NotACall`` (streaming, everything from there waits for the end of the
    output; at the end, the text up to ``close`` is content). A format whose marker opens a
    block of several calls (MiniMax-M2's) returns, and raises ``CallOpen`` with, the list of
    them. Not ``final``, a possible start of a call at the end is held back."""
    content: list[str] = []
    calls: list[ParsedToolCall] = []
    i = 0
    while True:
        found = [j for j in (text.find(tag, i) for tag in starts) if j >= 0]
        if not found:
            tail = text[i:]
            content.append(tail if final else tail[: len(tail) - held_back(tail, *starts)])
            break
        j = min(found)
        content.append(text[i:j])
        try:
            call, end = read_call(text, j, final)
        except CallOpen as partial:
            calls.extend(_listed(partial.args[0] if partial.args else None))
            break  # everything after waits for the call to close
        except NotACall:
            if not final:
                break  # held back until the output ends (content only grows)
            end = text.find(close, j)
            end = len(text) if end < 0 else end + len(close)
            content.append(text[j:end])
            i = end
            continue
        calls.extend(_listed(call))
        i = end
    joined = "".join(content).strip()
    return ExtractedToolCalls(joined or (None if final else ""), calls)


def schema_properties(functions: Mapping[str, dict], name: str) -> dict:
    """The ``properties`` of the parameter schema of the request's tool ``name`` ({} when
    there is no such tool, or its schema names none)."""
    fn = functions.get(name) or {}
    schema = fn.get("parameters") if isinstance(fn, dict) else None
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def typed_arguments(
    params: list[tuple[str, str]],
    props: Mapping[str, Any],
    convert: Callable[[str, Any], Any],
    closed: bool,
) -> str:
    """A call's arguments as JSON text, from its ``(key, raw value)`` pairs: each value
    ``convert(raw, schema)`` with its property's schema (None when the schema does not
    name it). A key given twice keeps its first value, so that what a stream sent stays a
    prefix; the closing ``}`` comes once ``closed``."""
    parts, seen = [], set()
    for key, raw in params:
        if key in seen:
            continue
        seen.add(key)
        value = json.dumps(convert(raw, props.get(key)), ensure_ascii=False)
        parts.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
    return "{" + ", ".join(parts) + ("}" if closed else "")


def section_tag(
    section_open: str,
    section_close: str,
    calls: list[str],
    rules: Sequence[str],
    special_tokens: Mapping[str, int],
    single: bool,
) -> dict:
    """A structural tag whose one structure is a section of calls: its open marker (the
    trigger), one of ``calls`` (Lark alternatives, using ``rules``), or more unless
    ``single``, apart by whitespace, and its close. The markers are matched as tokens
    where the tokenizer has them as special ones; free text cannot hold a special token,
    so the section, not each call, is the structure (DeepSeek, Kimi-K2, MiniMax-M2)."""
    more = "" if single else " (SECTION_WS? section_call)*"
    close = marker_lark(section_close, special_tokens)
    return {
        "triggers": [marker_trigger(section_open, special_tokens)],
        "rules": [*rules, "SECTION_WS: /[ \\t\\n]+/", "section_call: " + " | ".join(calls)],
        "structures": [
            {
                "begin": marker_begin(section_open, special_tokens),
                "lark": f"SECTION_WS? section_call{more} SECTION_WS? {close}",
                "end": "",
            }
        ],
    }


class SectionedCallParser(ToolParser):
    """Calls with JSON-object arguments between special tokens, grouped in a section
    (DeepSeek-V3 / V3.1, Kimi-K2)::

        SECTION_OPEN CALL_OPEN header {...} args_close... [CALL_OPEN ...] SECTION_CLOSE

    where ``args_close`` ends with ``CALL_CLOSE`` (DeepSeek-V3 closes a JSON fence first).
    A subclass names its markers and reads a call's header (``read_header``, an opening
    fence included). A call
    outside a section reads the same; whitespace between the calls of a section, and the
    section's markers, are not content. Streamed, a call appears once its header is
    complete and its ``arguments`` grow with the model's own JSON text."""

    keeps_special_tokens = True
    section_open: ClassVar[str]
    section_close: ClassVar[str]
    call_open: ClassVar[str]
    call_close: ClassVar[str]
    # What follows the arguments object, in order: each step one of its tags
    # (whitespace allowed before each).
    args_close: ClassVar[tuple[tuple[str, ...], ...]]
    # Lark lines the calls' expressions (``call_lark``) use.
    call_rules: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def structural_tag(
        cls,
        schemas: Mapping[str, dict | None],
        special_tokens: Mapping[str, int] = EMPTY,
        single: bool = False,
    ) -> dict | None:
        """The section's open marker opens the calls: then one call (``single``) or more,
        each naming one of the tools (its header: ``call_lark``) with arguments valid
        against its schema and the call's close, whitespace between them, and the
        section's close. The markers are matched as tokens where the tokenizer has them
        as special ones (so the section is the structure: free text cannot hold them)."""
        call_open = marker_lark(cls.call_open, special_tokens)
        call_close = marker_lark(cls.call_close, special_tokens)
        calls = [
            f"({call_open} {cls.call_lark(name, json_lark(schema or ANY_OBJECT), special_tokens)}"
            f" {call_close})"
            for name, schema in schemas.items()
        ]
        return section_tag(
            cls.section_open, cls.section_close, calls, cls.call_rules, special_tokens, single
        )

    @classmethod
    def call_lark(cls, name: str, arguments: str, special_tokens: Mapping[str, int]) -> str:
        """The Lark of a call between its open and close markers: the header naming
        ``name``, then ``arguments`` (a Lark expression) and what closes them before the
        call's close marker (DeepSeek-V3's fence)."""
        raise NotImplementedError(f"{cls.__name__} has no structural tag")

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        starts = (self.section_open, self.call_open)
        return scan_tagged_calls(text, final, starts, self.call_close, self._call)

    @abstractmethod
    def read_header(self, text: str, pos: int, final: bool) -> tuple[str, str | None, int]:
        """The header after ``call_open`` (at ``pos``): the function's name, the call's id
        if the model writes one, and where the arguments begin. Raises ``CallOpen(None)``
        while the text may still complete it, else ``NotACall``."""

    def _call(self, text: str, start: int, final: bool) -> tuple[ParsedToolCall, int]:
        pos = start
        if text.startswith(self.section_open, pos):
            pos = skip_ws(text, pos + len(self.section_open))
        if not text.startswith(self.call_open, pos):
            if not final and could_become(text[pos:], self.call_open):
                raise CallOpen(None)
            raise NotACall  # an empty section, or text in it before a call
        name, call_id, pos = self.read_header(text, pos + len(self.call_open), final)
        call, pos = self._arguments(text, skip_ws(text, pos), final, name, call_id)
        for tags in self.args_close:
            pos = skip_ws(text, pos)
            tag = next((t for t in tags if text.startswith(t, pos)), None)
            if tag is not None:
                pos += len(tag)
            elif final and pos >= len(text):
                return call, pos  # cut right after the arguments (a stop string): it holds
            elif not final and could_become(text[pos:], *tags):
                raise CallOpen(call)
            else:
                raise NotACall
        return call, self._after(text, pos, final, call)

    def _arguments(
        self, text: str, pos: int, final: bool, name: str, call_id: str | None
    ) -> tuple[ParsedToolCall, int]:
        """The call with its arguments object at ``pos`` (``{}`` when the model wrote
        none) and where the object ends."""
        if not text.startswith("{", pos):
            rest = text[pos:]
            if any(rest.startswith(tag) for tag in self.args_close[0]):
                return ParsedToolCall(name, "{}", True, call_id), pos
            if final or not could_become(rest, "{", *self.args_close[0]):
                raise NotACall
            raise CallOpen(ParsedToolCall(name, "", False, call_id))
        try:
            scan = scan_object(text, pos)
        except Malformed:
            raise NotACall from None
        if scan.end is None:
            if final:
                raise NotACall  # cut inside the arguments: they may be incomplete
            raise CallOpen(ParsedToolCall(name, text[pos:], False, call_id))
        arguments = text[pos : scan.end]
        try:
            valid = isinstance(json.loads(arguments), dict)
        except (ValueError, RecursionError):  # RecursionError: nested past the stack
            valid = False
        if not valid:
            raise NotACall
        return ParsedToolCall(name, arguments, True, call_id), scan.end

    def _after(self, text: str, pos: int, final: bool, call: ParsedToolCall) -> int:
        """Where the text after a whole call resumes: past the section's end and the
        whitespace before it or before the section's next call."""
        nxt = skip_ws(text, pos)
        if text.startswith(self.section_close, nxt):
            return nxt + len(self.section_close)
        if text.startswith(self.call_open, nxt):
            return nxt
        if not final and could_become(text[nxt:], self.section_close, self.call_open):
            raise CallOpen(call)  # may be the section's end or next call, arriving
        return pos
