"""DeepSeek-V3 / V3.1 (vLLM's ``deepseek_v3``): the model thinks only when the request's
``chat_template_kwargs`` ask it to (``{"thinking": true}``, the switch of V3.1's template,
or ``{"enable_thinking": true}``); then its output reads as DeepSeek-R1's
(``deepseek_r1``: everything before ``</think>`` is reasoning, an output that never
writes it all reasoning). Otherwise the whole output is content and there is no
reasoning, as vLLM reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.reasoning.abs_reasoning_parsers import register_reasoning_parser
from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser


@register_reasoning_parser("deepseek_v3")
class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    def thinking_enabled(self, chat_template_kwargs: Mapping[str, Any]) -> bool:
        return any(bool(chat_template_kwargs.get(k)) for k in ("thinking", "enable_thinking"))
