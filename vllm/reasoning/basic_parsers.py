"""Reasoning between ``<think>`` and ``</think>`` tags, the form every open thinking model
uses (``ThinkTagsReasoningParser``).

The chat templates of these models often open the block themselves (DeepSeek-R1's ends the
prompt with ``<think>\\n``; Qwen3's thinking variants too), so the output starts inside
the reasoning, with or without its own ``<think>``. Everything before ``</think>`` is
reasoning, then; an output that never closes the block (cut off by max_tokens) is all
reasoning and has no content, as in vLLM.

Leading whitespace of the reasoning and of the content is dropped (the templates put
newlines around the tags). Trailing whitespace is kept, so that the streamed pieces always
add up to the whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.reasoning.abs_reasoning_parsers import ExtractedReasoning, ReasoningParser, held_back


class ThinkTagsReasoningParser(ReasoningParser):
    start_tag = "<think>"
    end_tag = "</think>"
    # Tags that end the reasoning without an end tag and belong to the content (Qwen3's
    # tool calls, which the tool parser must see).
    content_starts: tuple[str, ...] = ()

    def __init__(self, chat_template_kwargs: Mapping[str, Any]) -> None:
        super().__init__(chat_template_kwargs)
        self.thinking = self.thinking_enabled(chat_template_kwargs)

    @property
    def end_of_reasoning(self) -> str | None:
        return self.end_tag if self.thinking else None

    def thinking_enabled(self, chat_template_kwargs: Mapping[str, Any]) -> bool:
        """Whether the model reasons at all for this request (default: it does)."""
        return True

    def extract(self, text: str, final: bool) -> ExtractedReasoning:
        if not self.thinking:
            return ExtractedReasoning(None, text, True)
        body = text.lstrip()
        if body.startswith(self.start_tag):
            body = body[len(self.start_tag) :].lstrip()
        elif not final and self.start_tag.startswith(body):
            return ExtractedReasoning("", "", False)  # may be the start tag, arriving
        end, after = self._end(body)
        if end >= 0:
            return ExtractedReasoning(body[:end], body[after:].lstrip(), True)
        if not final:
            body = body[: len(body) - held_back(body, (self.end_tag, *self.content_starts))]
        return ExtractedReasoning(body, "", False)

    def _end(self, body: str) -> tuple[int, int]:
        """Where the reasoning ends in ``body`` and where the content starts (-1, -1: not
        yet)."""
        end, after = body.find(self.end_tag), -1
        if end >= 0:
            after = end + len(self.end_tag)
        for tag in self.content_starts:
            at = body.find(tag)
            if at >= 0 and (end < 0 or at < end):
                end = after = at
        return end, after
