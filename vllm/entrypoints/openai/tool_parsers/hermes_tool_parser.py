"""Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import ClassVar

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ANY_OBJECT,
    EMPTY,
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    call_at,
    held_back,
    is_valid_call,
    marker_trigger,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.json_scan import skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """Any number of tagged calls; the text outside the tags is the content. A tag that
    is not closed (stop string, max_tokens) still counts once its JSON object is whole.
    Formats of the same shape with other tags name theirs (``tool_open``/``tool_close``)."""

    tool_open: ClassVar[str] = OPEN
    tool_close: ClassVar[str] = CLOSE

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        i = 0
        while True:
            j = text.find(self.tool_open, i)
            if j < 0:
                tail = text[i:]
                content.append(
                    tail if final else tail[: len(tail) - held_back(tail, self.tool_open)]
                )
                break
            content.append(text[i:j])
            close = text.find(self.tool_close, j + len(self.tool_open))
            end = close + len(self.tool_close) if close >= 0 else len(text)
            call = self._body(
                text[j + len(self.tool_open) : close if close >= 0 else len(text)], final
            )
            if call is not None:
                calls.append(call)
            elif final:  # not a call after all: the user sees the text
                content.append(text[j:end])
            i = end
        joined = "".join(content).strip()
        return ExtractedToolCalls(joined or (None if final else ""), calls)

    @classmethod
    def structural_tag(
        cls,
        schemas: Mapping[str, dict | None],
        special_tokens: Mapping[str, int] = EMPTY,
        single: bool = False,
    ) -> dict | None:
        """``<tool_call>`` opens a call: then ``{"name": <one of the tools>, "arguments":
        <valid against its schema>}`` and ``</tool_call>``, as the Hermes templates write
        them. Where ``<tool_call>`` is not a special token (SmolLM2's, Qwen2.5's) the
        trigger is its text up to the ``>``: a trigger shaped ``<...>`` is read by the
        grammar compiler as a special token's name."""
        trigger = marker_trigger(cls.tool_open, special_tokens)
        return {
            "triggers": [trigger],
            "structures": [
                {
                    "begin": f'{cls.tool_open}\n{{"name": {json.dumps(name)}, "arguments": ',
                    "schema": ANY_OBJECT if schema is None else schema,
                    "end": f"}}\n{cls.tool_close}",
                }
                for name, schema in schemas.items()
            ],
        }

    @staticmethod
    def _body(body: str, final: bool) -> ParsedToolCall | None:
        start = skip_ws(body, 0)
        if start >= len(body):
            return None
        if body[start] != "{":
            return None
        try:
            call, end = call_at(body, start)
        except ValueError:  # Malformed, or a key json cannot decode
            return None
        if not final:
            return call
        if end is None or body[end:].strip() or not is_valid_call(body[start:end]):
            return None
        return call


@register_tool_parser("longcat")
class LongcatToolParser(HermesToolParser):
    """LongCat-Flash's calls (vLLM's ``longcat``): Hermes' JSON in LongCat's own tags,
    ``<longcat_tool_call>{"name": ..., "arguments": {...}}</longcat_tool_call>``."""

    tool_open, tool_close = "<longcat_tool_call>", "</longcat_tool_call>"


_RESPONSE = ("<response>", "</response>")


@register_tool_parser("ernie45")
class Ernie45ToolParser(HermesToolParser):
    """ERNIE 4.5's calls (vLLM's ``ernie45``): Hermes' tagged JSON calls; an answer
    without a call comes in ``<response>`` ... ``</response>``, markers the content does
    not keep (streamed, a suffix that may begin one is held back)."""

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        out = super().extract_tool_calls(text, final)
        if out.content:
            content = out.content
            if not final:
                content = content[: len(content) - held_back(content, *_RESPONSE)]
            out.content = _unframed(content) or (None if final else "")
        return out

    def plain_content(self, text: str) -> str:
        return _unframed(text)


def _unframed(text: str) -> str:
    for marker in _RESPONSE:
        text = text.replace(marker, "")
    return text.strip()
