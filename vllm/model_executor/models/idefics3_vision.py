"""The vision encoder of Idefics3 and SmolVLM: a SigLIP ViT adapted to variable resolution
(transformers' ``Idefics3VisionTransformer`` / ``SmolVLMVisionTransformer``), for full tiles.

A tile ``(channels, image_size, image_size)`` is cut into non-overlapping ``patch_size``
squares by a convolution (with a bias, unlike CLIP's); learned position embeddings are
added (no CLS position), then the pre-norm encoder layers (full bidirectional attention,
an MLP of ``hidden_act``) and ``post_layernorm``. Tensors are named as transformers names
the module (``embeddings.``, ``encoder.layers.``, ``post_layernorm.``).

Positions: transformers maps each patch of a tile's *valid* area (``patch_attention_mask``)
to a bucket of the trained ``num_patches_per_side`` grid by fractional coordinates
(``bucketize`` of ``i / rows`` over the boundaries ``arange(1/n, 1, 1/n)`` in fp32). Only
tiles whose every patch is valid are taken here (the image processor's tiles of one image
are never padded); their buckets are computed the same way, so the float rounding that
makes transformers give two neighbouring patches one position for some grids (19, 25,
29, 31 patches a side...) is reproduced.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.model_executor.models.clip import CLIPVisionArch
from vllm.model_executor.models.siglip_vision import SiglipVisionModel

MODEL_TYPES = ("idefics3_vision", "smolvlm_vision")


@dataclass(frozen=True)
class Idefics3VisionArch(CLIPVisionArch):
    """CLIP's fields; every layer built."""

    @classmethod
    def from_hf(cls, config: Any) -> Idefics3VisionArch:
        """The arch of an HF ``Idefics3VisionConfig`` or ``SmolVLMVisionConfig``."""
        if config.model_type not in MODEL_TYPES:
            raise ValueError(
                f"vision_config model_type {config.model_type!r} is not one of {MODEL_TYPES}"
            )
        for field in ("image_size", "patch_size"):
            if not isinstance(getattr(config, field), int):
                raise ValueError(f"vision_config.{field} {getattr(config, field)!r}: one int")
        if config.image_size % config.patch_size:
            raise ValueError(
                f"vision_config.image_size {config.image_size} is not a multiple of "
                f"patch_size {config.patch_size}"
            )
        return cls.of_config(config, config.num_hidden_layers)


@functools.cache
def full_tile_position_ids(rows: int, cols: int, per_side: int) -> torch.Tensor:
    """(rows * cols,) position ids on the CPU, row-major, of a tile of ``rows`` x ``cols``
    valid patches, by transformers' fractional bucketing into a ``per_side`` x ``per_side``
    grid (module docstring): ``arange`` but where fp32 rounding repeats a bucket. Cached:
    do not modify the result."""
    cpu = torch.device("cpu")  # even under the loader's meta-device context
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side, dtype=torch.float32, device=cpu)

    def buckets(n: int) -> torch.Tensor:
        coords = torch.arange(n, dtype=torch.float32, device=cpu)
        coords = coords * (1.0 / torch.tensor(float(n), dtype=torch.float32, device=cpu))
        return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)

    return (buckets(rows)[:, None] * per_side + buckets(cols)[None, :]).flatten()


class Idefics3VisionEmbeddings(nn.Module):
    def __init__(self, a: Idefics3VisionArch) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            a.num_channels, a.hidden_size, a.patch_size, stride=a.patch_size
        )
        self.position_embedding = nn.Embedding(a.patches_per_side**2, a.hidden_size)
        self.per_side = a.patches_per_side

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_tiles, channels, size, size) -> (num_tiles, num_patches, hidden)."""
        patches = self.patch_embedding(pixel_values)  # (n, hidden, grid, grid)
        patches = patches.flatten(2).transpose(1, 2)  # (n, num_patches, hidden), row-major
        n = self.per_side
        ids = full_tile_position_ids(n, n, n).to(patches.device)
        return patches + self.position_embedding(ids)


class Idefics3VisionModel(SiglipVisionModel):
    """SigLIP's tower (its encoder and ``post_layernorm``) with Idefics3's position ids, on
    full tiles only (module docstring): a padded or smaller tile among the input is a
    ``ValueError``. Tensors named without the model's ``vision_model.`` prefix."""

    embeddings_class = Idefics3VisionEmbeddings
    takes = "full tiles: num_tiles"
