"""IBM Granite 3.2+ (vLLM's ``granite``): with ``chat_template_kwargs: {"thinking": true}``
the model writes ``Here is my thought process:`` (or ``Here's my thought process:``), its
reasoning, then ``Here is my response:`` (or ``Here's``) and the answer; plain words, no
special tokens. An output that does not open with the first phrase is all content; one
that never reaches the second (cut off) is all reasoning, as a ``<think>`` block left open
is. Without ``thinking`` the model does not reason: everything is content."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.reasoning.abs_reasoning_parsers import (
    ExtractedReasoning,
    ReasoningParser,
    held_back,
    register_reasoning_parser,
)

THINK_STARTS = ("Here is my thought process:", "Here's my thought process:")
RESPONSE_STARTS = ("Here is my response:", "Here's my response:")


@register_reasoning_parser("granite")
class GraniteReasoningParser(ReasoningParser):
    def __init__(self, chat_template_kwargs: Mapping[str, Any]) -> None:
        super().__init__(chat_template_kwargs)
        self.thinking = bool(chat_template_kwargs.get("thinking"))

    @property
    def end_of_reasoning(self) -> str | None:
        return RESPONSE_STARTS[0] if self.thinking else None

    def extract(self, text: str, final: bool) -> ExtractedReasoning:
        if not self.thinking:
            return ExtractedReasoning(None, text, True)
        body = text.lstrip()
        start = next((s for s in THINK_STARTS if body.startswith(s)), None)
        if start is None:
            if not final and any(s.startswith(body) for s in THINK_STARTS):
                return ExtractedReasoning("", "", False)  # may be the phrase, arriving
            return ExtractedReasoning(None, text, True)
        body = body[len(start) :].lstrip()
        ends = [(at, s) for s in RESPONSE_STARTS if (at := body.find(s)) >= 0]
        if ends:
            at, phrase = min(ends)
            return ExtractedReasoning(body[:at], body[at + len(phrase) :].lstrip(), True)
        if not final:
            body = body[: len(body) - held_back(body, RESPONSE_STARTS)]
        return ExtractedReasoning(body, "", False)
