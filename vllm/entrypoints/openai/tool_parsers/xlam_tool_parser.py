"""xLAM's calls (vLLM's ``xlam``: Salesforce's Large Action Models, made for agents): a
JSON list of call objects (``name``, ``arguments``), which the model writes as its whole
answer or in a block: a code fence (```` ```json ````, the language optional), between
``<tool_call>`` and ``</tool_call>``, or after ``[TOOL_CALLS]`` to the end of the line::

    I'll check both.
    ```json
    [{"name": "get_weather", "arguments": {"city": "Paris"}}]
    ```

The text around the block is the content. The first block whose body is a JSON list is
read; a block of anything else (a fence of Python code) stays content, and so does a list
that is not valid calls (the whole output then, as the ``json`` parser returns it).
Streamed, the content before the block flows, a call shows once its name is complete and
its arguments grow as written; the text after the block joins the content at the end.
"""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolParser,
    held_back,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import skip_ws
from vllm.entrypoints.openai.tool_parsers.json_tool_parser import JsonToolParser

FENCE, TAG_OPEN, TAG_CLOSE, BOT = "```", "<tool_call>", "</tool_call>", "[TOOL_CALLS]"
CLOSERS = {FENCE: FENCE, TAG_OPEN: TAG_CLOSE, BOT: "\n"}
_BARE = JsonToolParser()


@register_tool_parser("xlam")
class XlamToolParser(ToolParser):
    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        out = self._read(text, final)
        if not final:  # a call shows once its name is complete
            out.calls = [c for c in out.calls if c.name is not None]
        return out

    def _read(self, text: str, final: bool) -> ExtractedToolCalls:
        if text.lstrip().startswith("["):  # the whole answer is the list
            return _BARE.extract_tool_calls(text, final)
        pos = 0
        while True:
            at, opener = _next_opener(text, pos)
            if at < 0:
                return _content(text, final)
            start = at + len(opener)
            if opener == FENCE:
                if not final and "json".startswith(text[start:]):  # maybe its language
                    return _content(text[:at], True, "")
                if text.startswith("json", start):
                    start += len("json")
            start = skip_ws(text, start)
            if start >= len(text):  # the block's body has not begun
                return _content(text, True) if final else _content(text[:at], True, "")
            if text[start] != "[":  # a block of something else: content, read past it
                close = text.find(CLOSERS[opener], start)
                if close < 0:
                    return _content(text, final)
                pos = close + len(CLOSERS[opener])
                continue
            return self._block(text, at, opener, start, final)

    @staticmethod
    def _block(text: str, at: int, opener: str, start: int, final: bool) -> ExtractedToolCalls:
        before = text[:at]
        try:
            calls, end = JsonToolParser._calls(text, start, final)
        except ValueError:  # Malformed, or a key json cannot decode
            return _content(text, True) if final else _content(before, True, "")
        if not final:
            return ExtractedToolCalls(before.strip(), calls)
        if end is None or not calls:
            return _content(text, True)
        if opener == BOT:
            after = text[end:]
        else:
            close = skip_ws(text, end)
            if text.startswith(CLOSERS[opener], close):
                after = text[close + len(CLOSERS[opener]) :]
            elif close >= len(text):  # the block left open at the end
                after = ""
            else:  # stray text inside the block: not calls after all
                return _content(text, True)
        return ExtractedToolCalls((before + after).strip() or None, calls)


def _next_opener(text: str, pos: int) -> tuple[int, str]:
    found = [(at, o) for o in CLOSERS if (at := text.find(o, pos)) >= 0]
    return min(found) if found else (-1, "")


def _content(text: str, final: bool, empty: str | None = None) -> ExtractedToolCalls:
    """``text`` as content: whole when ``final`` (None if empty), else without a suffix
    that may begin a block."""
    if not final:
        text = text[: len(text) - held_back(text, *CLOSERS)]
        return ExtractedToolCalls(text.strip(), [])
    return ExtractedToolCalls(text.strip() or empty, [])
