"""Cohere Command (vLLM's ``cohere_command3`` and ``cohere_command4``): the reasoning is
the text between ``<|START_THINKING|>`` and ``<|END_THINKING|>``, which the output opens
with when the model thinks; an output that does not is all content, one cut before the
end marker all reasoning. The markers are special tokens, so these requests keep special
tokens in their text (``keeps_special_tokens``); the content keeps its other markers
(the answer's, the action blocks') for the tool parser, which drops them.

A guided output's grammar holds from the first token (``end_of_reasoning`` None): the
model may answer without thinking, and a grammar waiting for the end marker would then
never hold.
"""

from __future__ import annotations

from vllm.reasoning.abs_reasoning_parsers import (
    ExtractedReasoning,
    ReasoningParser,
    held_back,
    register_reasoning_parser,
)

START, END = "<|START_THINKING|>", "<|END_THINKING|>"


@register_reasoning_parser("cohere_command3", "cohere_command4")
class CohereCommandReasoningParser(ReasoningParser):
    keeps_special_tokens = True

    def extract(self, text: str, final: bool) -> ExtractedReasoning:
        body = text.lstrip()
        if not body.startswith(START):
            if not final and START.startswith(body):
                return ExtractedReasoning("", "", False)  # may be the marker, arriving
            return ExtractedReasoning(None, text, True)
        body = body[len(START) :].lstrip()
        end = body.find(END)
        if end >= 0:
            return ExtractedReasoning(body[:end], body[end + len(END) :].lstrip(), True)
        if not final:
            body = body[: len(body) - held_back(body, (END,))]
        return ExtractedReasoning(body, "", False)
