"""Reasoning parsers: split a thinking model's chain of thought from its answer.

``--reasoning-parser``'s choices come from the registry: adding a parser is one class
decorated with ``@register_reasoning_parser("name")`` in a module imported here.
"""

from __future__ import annotations

from vllm.reasoning import (  # noqa: F401
    cohere_command_reasoning_parser,
    deepseek_r1_reasoning_parser,
    deepseek_v3_reasoning_parser,
    gemma4_reasoning_parser,
    glm47_moe_reasoning_parser,
    gptoss_reasoning_parser,
    granite_reasoning_parser,
    kimi_k2_reasoning_parser,
    minimax_m2_reasoning_parser,
    olmo3_reasoning_parser,
    qwen3_reasoning_parser,
    seed_oss_reasoning_parser,
)
from vllm.reasoning.abs_reasoning_parsers import (
    ExtractedReasoning,
    ReasoningParser,
    count_reasoning_tokens,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = [
    "ExtractedReasoning",
    "ReasoningParser",
    "count_reasoning_tokens",
    "get_reasoning_parser",
    "reasoning_parser_names",
    "register_reasoning_parser",
]
