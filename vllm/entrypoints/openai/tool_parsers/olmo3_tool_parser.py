"""OLMo 3's calls (vLLM's ``olmo3``): pythonic calls, one a line, in a
``<function_calls>`` block::

    <function_calls>
    get_weather(city="Paris", days=3, detailed=true)
    bash(command="ls -la")
    </function_calls>

Each line is a call with keyword arguments whose values are literals, Python's or JSON's
(``true``, ``false``, ``null``), as the ``pythonic`` parser reads them. Text before and
after the block is the content (vLLM drops it). Without the block, an output whose every
line is such a call is read as calls too, as vLLM does.

Anything else is content, whole: a line that is not a call, a block that holds none, a
call cut by max_tokens (a block cut between two lines keeps the calls before the cut).

Streamed, a call in the block appears once its name is written and gets all its
arguments when its line ends; outside a block, only a whole line that is a call is one.
"""

from __future__ import annotations

import re

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    held_back,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import parse_call

OPEN, CLOSE = "<function_calls>", "</function_calls>"
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_WORD = re.compile(r"[A-Za-z_][\w.]*")  # what may still grow into a call's name


@register_tool_parser("olmo3")
class Olmo3ToolParser(ToolParser):
    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        start = text.find(OPEN)
        if start >= 0:
            close = text.find(CLOSE, start)
            body_end = close if close >= 0 else len(text)
            outside = text[:start] + (text[close + len(CLOSE) :] if close >= 0 else "")
            body, named = text[start + len(OPEN) : body_end], True
            done = final or close >= 0
        else:
            head = text.lstrip()
            if _NAME.match(head) is None:
                if not final and (_WORD.fullmatch(head) or OPEN.startswith(head)):
                    return ExtractedToolCalls("", [])  # may still become a call or the tag
                content = text if final else text[: len(text) - held_back(text, OPEN)]
                return ExtractedToolCalls(content.strip() or (None if final else ""), [])
            outside, body, named, done = "", text, False, final
        content = outside.strip()
        try:
            calls = self._lines(body, done, named)
        except ValueError as e:  # a line that is not a call
            if final:
                return ExtractedToolCalls(text.strip() or None, [])
            calls = e.args[1] if len(e.args) > 1 else []
            return ExtractedToolCalls(content if start >= 0 else "", calls)
        if final:
            if not calls:
                return ExtractedToolCalls(text.strip() or None, [])
            return ExtractedToolCalls(content or None, calls)
        return ExtractedToolCalls(content, calls)

    @staticmethod
    def _lines(body: str, done: bool, named: bool) -> list[ParsedToolCall]:
        """The calls of ``body``, one a line; the last line is whole only when ``done``.
        ``named``: an unfinished line that opens a call is reported by its name. Raises
        ``ValueError(message, calls_before)`` at a whole line that is not a call."""
        lines = body.split("\n")
        last = None if done else lines.pop()
        calls: list[ParsedToolCall] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                calls.append(parse_call(line))
            except ValueError:
                raise ValueError(f"not a call: {line[:80]!r}", calls) from None
        if named and last is not None and (match := _NAME.match(last)) is not None:
            calls.append(ParsedToolCall(match[1], "", False))
        return calls
