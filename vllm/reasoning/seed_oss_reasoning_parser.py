"""Seed-OSS (vLLM's ``seed_oss``): ``<seed:think>...</seed:think>`` then the answer, read
as vLLM reads Qwen3's (its Seed-OSS parser is its Qwen3 one with Seed's tags):

- The output starts inside the reasoning (with or without a ``<seed:think>`` of its own):
  everything before ``</seed:think>`` is reasoning; an output that never ends it is all
  reasoning.
- A ``<seed:tool_call>`` inside the reasoning ends it: the call, and what follows, is
  content for the tool parser (``--tool-call-parser seed_oss``).
- ``chat_template_kwargs={"enable_thinking": false}``: the whole output is content.

The markers are special tokens, kept in these requests' text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.reasoning.abs_reasoning_parsers import register_reasoning_parser
from vllm.reasoning.basic_parsers import ThinkTagsReasoningParser


@register_reasoning_parser("seed_oss")
class SeedOssReasoningParser(ThinkTagsReasoningParser):
    keeps_special_tokens = True
    start_tag = "<seed:think>"
    end_tag = "</seed:think>"
    content_starts = ("<seed:tool_call>",)

    def thinking_enabled(self, chat_template_kwargs: Mapping[str, Any]) -> bool:
        return bool(chat_template_kwargs.get("enable_thinking", True))
