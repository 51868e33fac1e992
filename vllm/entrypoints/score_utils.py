"""Scoring on an embedding model (a bi-encoder), shared by the server's ``/score`` and
``/rerank`` and ``LLM.score``: how two lists of texts pair up, and a pair's score (the
cosine similarity of its embeddings)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm.exceptions import VLLMValidationError


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
