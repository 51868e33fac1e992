"""OLMo 3 Think (vLLM's ``olmo3``): ``<think>...</think>`` then the answer. The tags are
plain text in OLMo 3's vocabulary (several tokens each), read here as text anyway.

The template opens the block in the prompt, so everything before ``</think>`` is
reasoning, with or without a ``<think>`` of the output's own. An output that never writes
``</think>`` (cut off) is all reasoning, as vLLM streams it; vLLM's non-streamed reading
makes such an output content instead, which no stream could match.
"""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import register_reasoning_parser
from vllm.reasoning.basic_parsers import ThinkTagsReasoningParser


@register_reasoning_parser("olmo3")
class Olmo3ReasoningParser(ThinkTagsReasoningParser):
    pass
