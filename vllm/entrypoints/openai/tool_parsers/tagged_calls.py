"""The scan shared by the parsers of tag-delimited calls (Qwen3-Coder's XML, GLM's
``<tool_call>name<arg_key>...``): content between calls, each call read by the parser's own
reader, and the streaming rules of ``ToolParser.extract_tool_calls``; and the reader of the
calls with JSON arguments grouped in a section of special tokens (DeepSeek, Kimi-K2)."""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Callable
from typing import ClassVar

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    held_back,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import Malformed, scan_object, skip_ws


class CallOpen(Exception):
    """The call goes on past the end of the text (streaming: wait for more); ``args[0]``:
    the call so far, or None before its name is complete."""


class NotACall(Exception):
    """The text at a call's start is not one (the user sees it as content)."""


def could_become(text: str, *tags: str) -> bool:
    """Whether ``text`` (the rest of the output) may still become one of ``tags``."""
    return any(tag.startswith(text) for tag in tags)


def scan_tagged_calls(
    text: str,
    final: bool,
    starts: tuple[str, ...],
    close: str,
    read_call: Callable[[str, int, bool], tuple[ParsedToolCall, int]],
) -> ExtractedToolCalls:
    """The calls in ``text`` and the content around them. A call begins at one of
    ``starts``; ``read_call(text, at, final)`` reads the one beginning at ``at`` and returns
    it with where it ends, or raises ``CallOpen`` (the text ends inside it: nothing after it
    is read yet) or ``NotACall`` (streaming, everything from there waits for the end of the
    output; at the end, the text up to ``close`` is content). Not ``final``, a possible
    start of a call at the end is held back."""
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
            if partial.args and partial.args[0] is not None:
                calls.append(partial.args[0])
            break  # everything after waits for the call to close
        except NotACall:
            if not final:
                break  # held back until the output ends (content only grows)
            end = text.find(close, j)
            end = len(text) if end < 0 else end + len(close)
            content.append(text[j:end])
            i = end
            continue
        calls.append(call)
        i = end
    joined = "".join(content).strip()
    return ExtractedToolCalls(joined or (None if final else ""), calls)


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
