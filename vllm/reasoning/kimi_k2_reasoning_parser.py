"""Kimi-K2 (vLLM's ``kimi_k2``): ``<think>...</think>`` then the answer, as vLLM reads it.

- The output starts inside the reasoning (with or without a ``<think>`` of its own):
  everything before ``</think>`` is reasoning; an output that never ends it is all
  reasoning.
- ``<|tool_calls_section_begin|>`` inside the reasoning ends it: the calls, and what
  follows, are content for the tool parser (``--tool-call-parser kimi_k2``).
- The reasoning's trailing whitespace is dropped (streamed, it waits until more reasoning
  follows).
- ``chat_template_kwargs`` ``{"thinking": false}`` or ``{"enable_thinking": false}``
  (neither set true): the whole output is content.

The markers are special tokens, kept in these requests' text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm.reasoning.abs_reasoning_parsers import ExtractedReasoning, register_reasoning_parser
from vllm.reasoning.basic_parsers import ThinkTagsReasoningParser


@register_reasoning_parser("kimi_k2")
class KimiK2ReasoningParser(ThinkTagsReasoningParser):
    keeps_special_tokens = True
    content_starts = ("<|tool_calls_section_begin|>",)

    def thinking_enabled(self, chat_template_kwargs: Mapping[str, Any]) -> bool:
        switches = [chat_template_kwargs.get(k) for k in ("thinking", "enable_thinking")]
        if all(s is None for s in switches):
            return True
        return any(bool(s) for s in switches)

    def extract(self, text: str, final: bool) -> ExtractedReasoning:
        # A prefix's rstrip is a prefix of the longer text's: the reasoning still only grows.
        out = super().extract(text, final)
        if not out.reasoning:
            return out
        return dataclasses.replace(out, reasoning=out.reasoning.rstrip())
