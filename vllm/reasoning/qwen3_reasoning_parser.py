"""Qwen3: ``<think>...</think>`` then the answer, as vLLM reads it.

- ``chat_template_kwargs={"enable_thinking": false}`` (Qwen3's template then writes an
  empty block into the prompt): the whole output is content.
- A ``<tool_call>`` inside the reasoning ends it: the call, and what follows, is content
  for the tool parser (``--tool-call-parser hermes``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.reasoning.abs_reasoning_parsers import register_reasoning_parser
from vllm.reasoning.basic_parsers import ThinkTagsReasoningParser


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkTagsReasoningParser):
    content_starts = ("<tool_call>",)

    def thinking_enabled(self, chat_template_kwargs: Mapping[str, Any]) -> bool:
        return chat_template_kwargs.get("enable_thinking", True) is not False
