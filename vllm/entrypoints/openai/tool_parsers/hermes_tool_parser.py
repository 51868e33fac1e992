"""Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
from collections.abc import Mapping

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
    is not closed (stop string, max_tokens) still counts once its JSON object is whole."""

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        i = 0
        while True:
            j = text.find(OPEN, i)
            if j < 0:
                tail = text[i:]
                content.append(tail if final else tail[: len(tail) - held_back(tail, OPEN)])
                break
            content.append(text[i:j])
            close = text.find(CLOSE, j + len(OPEN))
            end = close + len(CLOSE) if close >= 0 else len(text)
            call = self._body(text[j + len(OPEN) : close if close >= 0 else len(text)], final)
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
        trigger = marker_trigger(OPEN, special_tokens)
        return {
            "triggers": [trigger],
            "structures": [
                {
                    "begin": f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": ',
                    "schema": ANY_OBJECT if schema is None else schema,
                    "end": f"}}\n{CLOSE}",
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
