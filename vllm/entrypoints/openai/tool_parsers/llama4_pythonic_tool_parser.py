"""Llama 4's pythonic calls (vLLM's ``llama4_pythonic``): the ``pythonic`` list of calls,
which Llama 4 may wrap in its Python markers::

    <|python_start|>[get_weather(city="Tokyo", days=3)]<|python_end|>

The markers, where the detokenizer kept them, are dropped; the rest reads as ``pythonic``
reads it (an output that is not a list of calls is content).
"""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    held_back,
    register_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

PY_START, PY_END = "<|python_start|>", "<|python_end|>"


@register_tool_parser("llama4_pythonic")
class Llama4PythonicToolParser(PythonicToolParser):
    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        body = text.lstrip()
        if not body.startswith(PY_START):
            if not final and body and PY_START.startswith(body):
                return ExtractedToolCalls("", [])  # maybe the marker
            return super().extract_tool_calls(text, final)
        body = body[len(PY_START) :]
        if not final:
            body = body[: len(body) - held_back(body, PY_END)]
        return super().extract_tool_calls(body.replace(PY_END, ""), final)
