"""``openai``: gpt-oss's tool calls, harmony messages to ``functions.NAME``.

The chat endpoints read a gpt-oss model's output through the harmony plan
(``vllm/entrypoints/openai/harmony_plan.py``), automatically for a ``gpt_oss`` model and
whenever this parser or the ``openai_gptoss`` reasoning parser is named; this class gives
the name to ``--tool-call-parser`` (as vLLM's) and reads harmony text on its own too.
"""

from __future__ import annotations

from vllm.entrypoints.openai.harmony import read_harmony
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    register_tool_parser,
)


@register_tool_parser("openai")
class OpenAIToolParser(ToolParser):
    """Calls are the messages to a function, their arguments the model's own text (``{}``
    for an empty body); content is the final messages and preambles. The markers are
    special tokens, so its requests keep them in their text."""

    keeps_special_tokens = True

    def extract_tool_calls(self, text: str, final: bool) -> ExtractedToolCalls:
        reading = read_harmony(text, final)
        calls = [
            ParsedToolCall(m.function_name, call_arguments(m.text, final), m.complete or final)
            for m in reading.calls
        ]
        return ExtractedToolCalls(reading.content if final else reading.content or "", calls)


def call_arguments(text: str, final: bool) -> str:
    """A call's arguments string: the model's text; ``{}`` for a call without any."""
    return text if text or not final else "{}"
