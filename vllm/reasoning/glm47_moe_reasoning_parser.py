"""GLM-4.5 / 4.6 / 4.7 (vLLM's ``glm45`` and ``glm47``): ``<think>...</think>`` then the
answer, as vLLM reads it.

- GLM's template opens the reasoning in the prompt, so everything before ``</think>`` is
  reasoning, with or without a ``<think>`` of the output's own; an output cut before
  ``</think>`` is all reasoning.
- A ``<tool_call>`` inside the reasoning ends it: the call, and what follows, is content
  for the tool parser (``--tool-call-parser glm45``).
- ``chat_template_kwargs`` ``{"enable_thinking": false}`` (GLM's switch) or
  ``{"thinking": false}``, and neither set true: the whole output is content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.reasoning.abs_reasoning_parsers import register_reasoning_parser
from vllm.reasoning.basic_parsers import ThinkTagsReasoningParser


@register_reasoning_parser("glm45", "glm47")
class Glm47MoeReasoningParser(ThinkTagsReasoningParser):
    content_starts = ("<tool_call>",)

    def thinking_enabled(self, chat_template_kwargs: Mapping[str, Any]) -> bool:
        switches = [chat_template_kwargs.get(k) for k in ("thinking", "enable_thinking")]
        if all(s is None for s in switches):
            return True
        return any(bool(s) for s in switches)
