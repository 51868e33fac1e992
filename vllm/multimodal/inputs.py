"""A prompt's images as the engine carries them from the front end to the model runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MultiModalFeature:
    """One image of a prompt: its encoder input and the placeholder tokens it fills.

    The prompt holds ``length`` placeholder tokens from ``offset`` on; at those positions
    the model reads the image's embeddings (its vision encoder's output on ``data``)
    instead of the placeholder token's. ``identifier`` names the image's content (a hash
    of ``data``): it joins the prefix cache's hash of every block the placeholders
    touch, so two prompts share those blocks only when their images are equal.
    """

    modality: str  # "image"
    data: torch.Tensor  # the encoder's input: pixel values (3, H, W), fp32, on the host
    offset: int
    length: int
    identifier: str

    @property
    def end(self) -> int:
        return self.offset + self.length


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
