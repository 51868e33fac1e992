"""A prompt's images as the engine carries them from the front end to the model runner."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class MultiModalFeature:
    """One image of a prompt: its encoder input and the placeholder tokens it fills.

    The prompt holds the image's ``length`` tokens from ``offset`` on; at those positions
    (those ``is_embed`` marks, when it is given: a model may put text tokens between an
    image's tiles, vLLM's ``PlaceholderRange.is_embed``) the model reads the image's
    embeddings, its vision encoder's output on ``data`` in order, instead of the token's
    own. ``data`` holds the image's tiles (one for a model that takes the image whole);
    the encoder makes the same number of rows of each. ``identifier`` names the image's
    content (a hash of ``data``): it joins the prefix cache's hash of every block the
    image touches, so two prompts share those blocks only when their images are equal.
    """

    modality: str  # "image"
    data: torch.Tensor  # the encoder's input: (tiles, 3, H, W) pixel values, on the host
    offset: int
    length: int
    identifier: str
    is_embed: list[bool] | None = None  # per position: an embedding's (None: all are)
    # Qwen2-VL's: the image's patch grid (temporal, height, width) as its encoder takes it,
    # and its grid of tokens (after the spatial merge), which M-RoPE's positions follow.
    grid_thw: tuple[int, int, int] | None = None
    mrope_grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """The embeddings the vision encoder makes of it (vLLM's ``get_num_embeds``)."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embedding_rows(self, lo: int, hi: int) -> tuple[list[int], int, int]:
        """For the image's positions ``[lo, hi)``: (those of them that take an embedding,
        relative to ``lo``; the first and one past the last embedding row they take)."""
        if self.is_embed is None:
            return list(range(hi - lo)), lo, hi
        first = sum(self.is_embed[:lo])
        taken = [p - lo for p in range(lo, hi) if self.is_embed[p]]
        return taken, first, first + len(taken)


def features_in(
    features: list[MultiModalFeature] | None, start: int, end: int
) -> list[tuple[int, int, int]]:
    """``(index, lo, hi)`` for each feature whose placeholders meet positions
    ``[start, end)``: the feature's own rows ``[lo, hi)`` that fall there."""
    found = []
    for i, f in enumerate(features or ()):
        lo, hi = max(start, f.offset), min(end, f.end)
        if lo < hi:
            found.append((i, lo - f.offset, hi - f.offset))
    return found


def mrope_positions(features: list[MultiModalFeature] | None, start: int, end: int) -> np.ndarray:
    """M-RoPE's (temporal, height, width) positions of a request's tokens ``[start, end)``
    (Qwen2-VL's ``get_rope_index``; the outputs' too: they are text after the last image).
    An image's tokens, grid
    ``(t, h, w)``, take ``base + (t_i, h_i, w_i)``, where ``base`` is the position the
    text before it reached; the text after it goes on from ``base + max(t, h, w)``. A text
    token's three positions are equal: its index plus the shift of the images before it.
    """
    index = np.arange(start, end)
    out = np.empty((3, end - start), dtype=np.int64)
    shift = np.zeros(end - start, dtype=np.int64)
    total = 0
    inside = np.zeros(end - start, dtype=bool)
    for f in sorted(features or (), key=lambda f: f.offset):
        t, h, w = f.mrope_grid
        mine = (index >= f.offset) & (index < f.end)
        if mine.any():
            rel = index[mine] - f.offset
            base = f.offset + total
            out[0, mine] = base + rel // (h * w)
            out[1, mine] = base + (rel // w) % h
            out[2, mine] = base + rel % w
            inside |= mine
        total += max(t, h, w) - f.length
        shift[index >= f.end] = total
    text = ~inside
    out[:, text] = index[text] + shift[text]
    return out


class EncoderCache:
    """The vision encoder's outputs of recent images, by identifier, least recently used
    first out past ``max_rows`` rows in all (vLLM's encoder cache, across requests): an
    image sent again (an agent's screenshot in each turn's history) whose prefix-cache hit
    ends inside it, or whose blocks were evicted, is not encoded again."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._rows: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._size = 0
        self.hits = 0

    def __contains__(self, identifier: str) -> bool:
        """Whether it holds the image (without touching its recency)."""
        return identifier in self._rows

    def get(self, identifier: str) -> torch.Tensor | None:
        rows = self._rows.get(identifier)
        if rows is not None:
            self._rows.move_to_end(identifier)
            self.hits += 1
        return rows

    def put(self, identifier: str, rows: torch.Tensor) -> None:
        if rows.shape[0] > self.max_rows or identifier in self._rows:
            return
        self._rows[identifier] = rows
        self._size += rows.shape[0]
        while self._size > self.max_rows:
            _, old = self._rows.popitem(last=False)
            self._size -= old.shape[0]

    def clear(self) -> None:
        self._rows.clear()
        self._size = 0
