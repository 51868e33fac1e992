"""DeepSeek-R1 (and its distills, QwQ): ``<think>...</think>`` then the answer."""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import register_reasoning_parser
from vllm.reasoning.basic_parsers import ThinkTagsReasoningParser


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagsReasoningParser):
    pass
