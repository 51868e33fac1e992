"""Phi-4-mini's calls (vLLM's ``phi4_mini_json``): ``functools`` and a JSON list of call
objects::

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

``parameters`` is read for ``arguments`` too. Text before ``functools`` and after the
list is the content (vLLM drops it); a list that is not valid calls, or is cut off, is
content whole (vLLM reports a call without calls then). Streamed, as the ``json`` parser:
a call shows once its name is complete, its arguments grow with the text.
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

TAG = "functools"


@register_tool_parser("phi4_mini_json")
class Phi4MiniJsonToolParser(ToolParser):
    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        at, start = _list_start(text)
        if at < 0:
            content = text if final else text[: len(text) - held_back(text, TAG + "[")]
            return ExtractedToolCalls(content.strip() or (None if final else ""), [])
        before = text[:at]
        if start >= len(text):  # the tag, its list not yet begun (or never: a word)
            return ExtractedToolCalls((text.strip() or None) if final else before.strip(), [])
        try:
            calls, end = JsonToolParser._calls(text, start, final)
        except ValueError:  # Malformed, or a key json cannot decode
            if final:
                return ExtractedToolCalls(text.strip() or None, [])
            return ExtractedToolCalls(before.strip(), [])  # held back until the end
        if not final:
            after = text[end:] if end is not None else ""
            return ExtractedToolCalls((before + after).strip(), calls)
        if end is None or not calls:
            return ExtractedToolCalls(text.strip() or None, [])
        return ExtractedToolCalls((before + text[end:]).strip() or None, calls)


def _list_start(text: str) -> tuple[int, int]:
    """Where the first ``functools`` that may open a list is, and where its list begins
    (``len(text)`` while it has not yet); (-1, -1): none (a ``functools`` followed by
    anything but ``[`` is a word of the content)."""
    at = text.find(TAG)
    while at >= 0:
        start = skip_ws(text, at + len(TAG))
        if start >= len(text) or text[start] == "[":
            return at, start
        at = text.find(TAG, at + 1)
    return -1, -1
