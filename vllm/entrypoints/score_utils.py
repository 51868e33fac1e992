"""Scoring, shared by the server's ``/score`` and ``/rerank`` and ``LLM.score``: how two
lists of texts pair up, and how a pair is scored, as vLLM does by the served model.

- A bi-encoder (an embedding model): each text embedded on its own, a pair's score the
  cosine similarity of its two embeddings (``pair_scores``).
- A cross-encoder (a classifier with one label, a reranker): each pair one prompt
  (``pair_token_ids``), its score the classifier's output for it (the sigmoid of the
  logit, or the logit with ``use_activation`` off).

A classifier with more labels, or a generating model, scores nothing (``ScoringModel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from vllm.exceptions import VLLMValidationError

ScoreType = Literal["bi-encoder", "cross-encoder"]
# Arguments of apply_chat_template that the pair's template may not be handed.
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tools", "tokenize"})


def check_pairing(first: Sequence, second: Sequence, names: tuple[str, str]) -> None:
    """``VLLMValidationError`` naming the side unless both hold texts, none empty, and
    ``first`` and ``second`` pair 1:1, 1:N (the one first text against each second one)
    or N:N (in order)."""
    for side, name in zip((first, second), names, strict=True):
        if not side:
            raise VLLMValidationError(f"{name} must hold at least one text", name)
        if any(not text for text in side):
            raise VLLMValidationError(f"{name} must not hold an empty text", name)
    if len(first) > 1 and len(first) != len(second):
        raise VLLMValidationError(
            f"{names[0]} and {names[1]} must pair 1:1, 1:N or N:N, got {len(first)}:{len(second)}",
            names[0],
        )


def pair_scores(first: Sequence[Sequence[float]], second: Sequence[Sequence[float]]) -> list[float]:
    """The cosine similarity of each pair of embeddings (a lone first one is paired with
    every second one), in float64."""
    a = np.asarray(first, dtype=np.float64)
    b = np.asarray(second, dtype=np.float64)
    if len(a) == 1:
        a = np.repeat(a, len(b), axis=0)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (np.einsum("ij,ij->i", a, b) / np.maximum(norms, 1e-12)).tolist()


@dataclass(frozen=True)
class ScoringModel:
    """How the served model scores, read once from its config (vLLM's choice by its
    pooling task): an embedding model as a bi-encoder, a classifier with one label as a
    cross-encoder; ``kind`` None, and ``refusal`` saying why, for a generating model or a
    classifier with more labels (what would its score be?). ``sep_token``: a pair is the
    tokenizer's pair encoding (vLLM's ``use_sep_token``, on unless the config says
    otherwise, also under its older name ``use_pad_token``) rather than the two texts
    joined. ``template``: the score template's text (--chat-template), or None."""

    kind: ScoreType | None
    refusal: str = ""
    sep_token: bool = True
    template: str | None = None

    @classmethod
    def of(cls, model_config: Any) -> ScoringModel:
        from vllm.model_executor.model_loader import hf_config_of
        from vllm.model_executor.models.adapters import num_labels_of

        task = model_config.pooling_task
        if task == "embed":
            return cls("bi-encoder")
        if task != "classify":
            return cls(None, "embeddings and scores need a model served with --runner pooling")
        config = hf_config_of(model_config)
        num_labels = num_labels_of(config)
        if num_labels != 1:
            return cls(None, "scores need an embedding model or a classifier with one label "
                       f"(a reranker); this classifier has {num_labels} labels: use "
                       "/classify (LLM.classify)")  # fmt: skip
        old = getattr(config, "use_pad_token", None)
        sep = old if old is not None else getattr(config, "use_sep_token", True)
        template = read_template(getattr(model_config, "chat_template", None))
        return cls("cross-encoder", sep_token=bool(sep), template=template)

    def require(self) -> ScoreType:
        """``kind``, or the ``VLLMValidationError`` (naming ``model``) of its refusal."""
        if self.kind is None:
            raise VLLMValidationError(self.refusal, "model")
        return self.kind


def read_template(template: str | None) -> str | None:
    """A score template given as a file path or as template text (--chat-template's)."""
    if template is None:
        return None
    path = Path(template)
    return path.read_text() if len(template) < 4096 and path.is_file() else template


def template_kwargs(
    instruction: str | None, kwargs: dict[str, Any] | None, template: str | None
) -> dict[str, Any]:
    """The score template's variables: ``kwargs`` with ``instruction`` as its
    ``instruction`` unless it names one (vLLM's). ``VLLMValidationError`` naming the field
    when there is no template to read them, or a key is the template call's own."""
    merged = dict(kwargs or {})
    if instruction is not None:
        merged.setdefault("instruction", instruction)
    if merged and template is None:
        field = "instruction" if instruction is not None else "chat_template_kwargs"
        raise VLLMValidationError(
            f"{field} needs a score template (--chat-template): without one a pair is "
            "the tokenizer's encoding of the two texts, which has no variables",
            field,
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & merged.keys())
    if reserved:
        raise VLLMValidationError(
            f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs"
        )
    return merged


def pair_token_ids(
    tokenizer: Any,
    query: str,
    document: str,
    template: str | None = None,
    kwargs: dict[str, Any] | None = None,
    sep_token: bool = True,
) -> list[int]:
    """A cross-encoder's prompt for one pair, as vLLM builds it: the template rendered
    over a ``query`` and a ``document`` message then tokenized, else the tokenizer's pair
    encoding (``tokenizer(query, document)``), else (``sep_token`` off: an LLM as
    reranker) the two texts joined."""
    if template is not None:
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, **(kwargs or {})
            )
        except TemplateError as e:
            raise VLLMValidationError(
                f"the score template failed: {e}", "chat_template_kwargs"
            ) from e
        return tokenizer(text)["input_ids"]
    if sep_token:
        return tokenizer(text=query, text_pair=document)["input_ids"]
    return tokenizer(text=query + document)["input_ids"]


def pairs(first: Sequence, second: Sequence) -> list[tuple[Any, Any]]:
    """The scored pairs of a checked pairing: a lone first text with each second one."""
    lead = list(first) * len(second) if len(first) == 1 else list(first)
    return list(zip(lead, second, strict=True))
