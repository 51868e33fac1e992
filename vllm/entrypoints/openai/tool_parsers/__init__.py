"""Tool parsers: turn a model's output into OpenAI ``tool_calls``.

``--tool-call-parser``'s choices come from the registry: adding a parser is one class
decorated with ``@register_tool_parser("name")`` in a module imported here.
"""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers import (  # noqa: F401
    cohere_command_tool_parser,
    deepseek_tool_parser,
    deepseek_v32_tool_parser,
    gemma4_tool_parser,
    glm47_moe_tool_parser,
    hermes_tool_parser,
    json_tool_parser,
    kimi_k2_tool_parser,
    llama4_pythonic_tool_parser,
    minimax_m2_tool_parser,
    mistral_tool_parser,
    olmo3_tool_parser,
    openai_tool_parser,
    phi4mini_tool_parser,
    pythonic_tool_parser,
    qwen3coder_tool_parser,
    seed_oss_tool_parser,
    xlam_tool_parser,
)
from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_class,
    tool_parser_names,
)

__all__ = [
    "ExtractedToolCalls",
    "ParsedToolCall",
    "ToolParser",
    "get_tool_parser",
    "register_tool_parser",
    "tool_parser_class",
    "tool_parser_names",
]
