"""MiniMax-M2 / M2.1 / M2.5 (vLLM's ``minimax_m2`` and ``minimax_m2_append_think``).

MiniMax-M2's chat template ends the prompt with ``]~b]ai\\n<think>\\n``: the model starts
inside its reasoning and writes ``</think>`` before the answer (and before its
``<minimax:tool_call>`` blocks), usually without a ``<think>`` of its own.

- ``minimax_m2``: vLLM's ``<think>``/``</think>`` reading (its ``BaseThinkingReasoningParser``).
  Everything before ``</think>`` is reasoning, with or without a ``<think>`` in the output;
  an output that never writes ``</think>`` (cut off) is all reasoning. No switch turns the
  thinking off: M2 always thinks.
- ``minimax_m2_append_think`` (MiniMax's recommended flag): nothing is split off. The
  whole output is content with the ``<think>`` the template wrote prepended, so that the
  content is ``<think>...</think>answer``, as the model wrote it, and a client that sends
  it back in the history (MiniMax's interleaved thinking wants the reasoning there) gives
  the template a whole block; ``reasoning`` stays empty. vLLM prepends the tag
  unconditionally; here an output that opens with ``<think>`` itself gets no second one.
  A guided output's grammar holds after ``</think>`` for both (vLLM's ``is_reasoning_end``
  looks for that token).

The tags are added tokens in MiniMax's vocabulary, possibly special, so these requests
keep special tokens in their text.
"""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import (
    ExtractedReasoning,
    ReasoningParser,
    register_reasoning_parser,
)
from vllm.reasoning.basic_parsers import ThinkTagsReasoningParser

START, END = "<think>", "</think>"


@register_reasoning_parser("minimax_m2")
class MiniMaxM2ReasoningParser(ThinkTagsReasoningParser):
    keeps_special_tokens = True


@register_reasoning_parser("minimax_m2_append_think")
class MiniMaxM2AppendThinkReasoningParser(ReasoningParser):
    keeps_special_tokens = True

    @property
    def end_of_reasoning(self) -> str | None:
        return END

    def extract(self, text: str, final: bool) -> ExtractedReasoning:
        opened = text.lstrip()
        if opened.startswith(START):
            return ExtractedReasoning(None, text, True)
        if not final and START.startswith(opened):
            return ExtractedReasoning(None, "", True)  # may be the model's own tag, arriving
        return ExtractedReasoning(None, START + text, True)
