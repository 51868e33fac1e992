"""Gemma 4 (vLLM's ``gemma4``): its thinking in a channel block before the answer::

    <|channel>thought
    The user wants...<channel|>The answer.

Unlike the ``<think>`` models, Gemma 4 reasons only when asked
(``chat_template_kwargs={"enable_thinking": true}``), so an output that does not open
with ``<|channel>`` is all content. A block the model opens is reasoning, whether or not
thinking was asked for, up to ``<channel|>``; its ``thought`` label and the newline after
it are not; a block never closed (cut off by max_tokens) is all reasoning. The markers
are special tokens, kept in these requests' text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.reasoning.abs_reasoning_parsers import (
    ExtractedReasoning,
    ReasoningParser,
    held_back,
    register_reasoning_parser,
)

CHANNEL_OPEN, CHANNEL_CLOSE = "<|channel>", "<channel|>"
LABEL = "thought\n"


@register_reasoning_parser("gemma4")
class Gemma4ReasoningParser(ReasoningParser):
    keeps_special_tokens = True

    def __init__(self, chat_template_kwargs: Mapping[str, Any]) -> None:
        super().__init__(chat_template_kwargs)
        self.thinking = bool(chat_template_kwargs.get("enable_thinking", False))

    @property
    def end_of_reasoning(self) -> str | None:
        return CHANNEL_CLOSE if self.thinking else None

    def extract(self, text: str, final: bool) -> ExtractedReasoning:
        body = text.lstrip()
        if not body.startswith(CHANNEL_OPEN):
            if not final and CHANNEL_OPEN.startswith(body):
                return ExtractedReasoning(None, "", False)  # may be the block, arriving
            return ExtractedReasoning(None, text, True)
        body = body[len(CHANNEL_OPEN) :]
        if body.startswith(LABEL):
            body = body[len(LABEL) :]
        elif not final and LABEL.startswith(body):
            return ExtractedReasoning("", "", False)  # the label, arriving
        end = body.find(CHANNEL_CLOSE)
        if end >= 0:
            return ExtractedReasoning(body[:end], body[end + len(CHANNEL_CLOSE) :].lstrip(), True)
        if not final:
            body = body[: len(body) - held_back(body, (CHANNEL_CLOSE,))]
        return ExtractedReasoning(body, "", False)
