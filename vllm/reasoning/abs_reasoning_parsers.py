"""The reasoning parser interface and the registry that feeds ``--reasoning-parser``.

A thinking model (Qwen3, DeepSeek-R1, QwQ) writes its chain of thought before the answer,
between ``<think>`` and ``</think>``. With a reasoning parser the server returns that part
as the message's ``reasoning`` (vLLM's field) and only the rest as ``content``; the tool
parser, if any, reads that rest.

Parsers read text, not token ids, so they work whatever the tokenizer makes of the tags.
Like the tool parsers they are stateless and re-read the whole output each time: one
instance may serve every request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.utils.registry import ClassRegistry

_REGISTRY: ClassRegistry[type[ReasoningParser]] = ClassRegistry(
    "reasoning parser", "reasoning_parser"
)
# Class decorator: the parser is offered to ``--reasoning-parser`` under the given names.
register_reasoning_parser = _REGISTRY.register
reasoning_parser_names = _REGISTRY.names


def get_reasoning_parser(
    name: str, chat_template_kwargs: Mapping[str, Any] | None = None
) -> ReasoningParser:
    """The parser ``name`` for one request (``chat_template_kwargs``: the request's, which
    may switch thinking off)."""
    return _REGISTRY.get(name)(chat_template_kwargs or {})


@dataclass(frozen=True)
class ExtractedReasoning:
    """One reading of the output so far.

    ``reasoning``: the chain of thought (None: the model did not reason); ``content``:
    the text after it, which the tool parser or the client gets; ``ended``: the reasoning
    is over (its end tag, or what implies it, has been seen)."""

    reasoning: str | None
    content: str
    ended: bool


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that could begin one of ``tags``."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if tag.startswith(text[-n:]):
                longest = n
                break
    return longest


class ReasoningParser(ABC):
    """Splits a model's output into reasoning and content."""

    # The requests it reads keep special tokens in their text (its markers are special
    # tokens, as Cohere's <|START_THINKING|>).
    keeps_special_tokens: bool = False

    def __init__(self, chat_template_kwargs: Mapping[str, Any]) -> None:
        self.chat_template_kwargs = chat_template_kwargs

    @property
    def end_of_reasoning(self) -> str | None:
        """The text that ends the reasoning, after which a guided output's grammar holds
        (``StructuredOutputsParams.after_reasoning``); None: this request does not reason,
        the grammar holds from the first token."""
        return None

    @abstractmethod
    def extract(self, text: str, final: bool) -> ExtractedReasoning:
        """``final``: ``text`` is the whole output. Not ``final`` (streaming), the text may
        stop at any character: a possible start of a tag is held back, and both
        ``reasoning`` and ``content`` only grow (each reading's is a prefix of the next
        one's, and of the final one's)."""


def count_reasoning_tokens(
    parser: ReasoningParser, token_ids: Sequence[int], decode: Callable[[Sequence[int]], str]
) -> int:
    """How many of the output's ``token_ids`` are its reasoning: those after the last
    token before the reasoning's first character (a ``<think>`` tag, whitespace) and up to
    the token that ends it (its end tag; if it never ends, the last one with text: a
    closing EOS is not reasoning). With one token a
    tag, as in every thinking model's vocabulary, that is the tokens between the tags,
    as vLLM counts. ``decode``: the ids as the request's text was made from them. Found
    by bisection over prefixes: O(log n) decodes."""

    def first(holds: Callable[[ExtractedReasoning], bool]) -> int | None:
        """The shortest prefix length k (1..n) whose reading ``holds``; None: none does."""
        lo, hi = 1, len(token_ids)
        if hi == 0 or not holds(parser.extract(decode(token_ids[:hi]), final=False)):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if holds(parser.extract(decode(token_ids[:mid]), final=False)):
                hi = mid
            else:
                lo = mid + 1
        return lo

    start = first(lambda r: bool(r.reasoning))
    if start is None:
        return 0
    end = first(lambda r: r.ended)
    if end is None:  # never ended: up to the token that completes its text (not an EOS)
        whole = len(parser.extract(decode(token_ids), final=False).reasoning or "")
        last = first(lambda r: len(r.reasoning or "") >= whole) or len(token_ids)
    else:
        last = end - 1
    return max(last - (start - 1), 0)
