"""``openai_gptoss``: gpt-oss's reasoning, its harmony ``analysis`` channel.

The chat endpoints read a gpt-oss model's output through the harmony plan
(``vllm/entrypoints/openai/harmony_plan.py``), automatically for a ``gpt_oss`` model and
whenever this parser or the ``openai`` tool parser is named; this class gives the name to
``--reasoning-parser`` (as vLLM's) and reads harmony text on its own too: the reasoning is
the analysis messages, the content the final ones (and preambles).
"""

from __future__ import annotations

from vllm.entrypoints.openai.harmony import read_harmony
from vllm.reasoning.abs_reasoning_parsers import (
    ExtractedReasoning,
    ReasoningParser,
    register_reasoning_parser,
)


@register_reasoning_parser("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    """Harmony's reasoning; no end tag for a guided output's grammar to wait for (its
    grammar holds from the first token, so that output is plain text, read as content)."""

    def extract(self, text: str, final: bool) -> ExtractedReasoning:
        reading = read_harmony(text, final)
        return ExtractedReasoning(reading.reasoning, reading.content or "", reading.reasoning_ended)
