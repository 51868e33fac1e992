"""SigLIP's vision encoder as Gemma 3 reads it (transformers' ``SiglipVisionModel``, its
``last_hidden_state``): square images of the trained size only.

Pixels ``(num_images, channels, image_size, image_size)`` are cut into ``patch_size``
squares by a convolution with a bias ("valid" padding: an ``image_size`` that is not a
multiple of ``patch_size`` drops the last pixels, as SigLIP-so400m's 384 / 14 does); one
learned position embedding per patch is added, position ``i`` to the ``i``-th patch in
row-major order (no class position, no interpolation, no bucketing: idefics3_vision.py's
fractional positions are a different model's). Then the pre-norm encoder layers (clip.py's
``CLIPEncoder``: full bidirectional attention, an MLP of ``hidden_act``) and
``post_layernorm``. The attention-pooling head (``vision_use_head``) is not built: Gemma 3
reads the hidden states before it, and its tensors are ignored when loading. Tensors are
named as transformers names the module (``embeddings.``, ``encoder.layers.``,
``post_layernorm.``), with or without the ``vision_model.`` of the Hub's checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.clip import (
    CLIPEncoder,
    CLIPVisionArch,
    load_encoder_tensors,
)

MODEL_TYPE = "siglip_vision_model"


@dataclass(frozen=True)
class SiglipVisionArch(CLIPVisionArch):
    """CLIP's fields; every layer built."""

    @classmethod
    def from_hf(cls, config: Any) -> SiglipVisionArch:
        """The arch of an HF ``SiglipVisionConfig``; ``ValueError`` naming the field it
        cannot serve."""
        if config.model_type != MODEL_TYPE:
            raise ValueError(f"vision_config model_type {config.model_type!r} is not {MODEL_TYPE}")
        for field in ("image_size", "patch_size"):
            value = getattr(config, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"vision_config.{field} {value!r}: one positive int")
        if config.patch_size > config.image_size:
            raise ValueError(
                f"vision_config.patch_size {config.patch_size} is larger than image_size "
                f"{config.image_size}"
            )
        return cls.of_config(config, config.num_hidden_layers)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, a: SiglipVisionArch) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            a.num_channels, a.hidden_size, a.patch_size, stride=a.patch_size
        )
        self.position_embedding = nn.Embedding(a.num_patches, a.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, channels, size, size) -> (n, num_patches, hidden)."""
        patches = self.patch_embedding(pixel_values)  # (n, hidden, grid, grid)
        patches = patches.flatten(2).transpose(1, 2)  # (n, num_patches, hidden), row-major
        return patches + self.position_embedding.weight  # position ids: arange(num_patches)


class SiglipVisionModel(nn.Module):
    """The whole encoder and ``post_layernorm``; submodules named as HF's, q/k/v fused
    (``load_weights`` fuses them). Idefics3's tower is this one with its own position
    ids (``embeddings_class``)."""

    embeddings_class: ClassVar[type[nn.Module]] = SiglipVisionEmbeddings
    # How a wrong input's shape is told: what the tower takes.
    takes: ClassVar[str] = "num_images"

    def __init__(self, arch: SiglipVisionArch) -> None:
        super().__init__()
        self.arch = arch
        self.embeddings = self.embeddings_class(arch)
        self.encoder = CLIPEncoder(arch)
        self.post_layernorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(n, channels, image_size, image_size) pixels, in any float dtype, on any device
        -> (n, num_patches, hidden) in the weights' dtype, on their device: transformers'
        ``last_hidden_state``, row-major patches. ``ValueError`` for another shape."""
        a = self.arch
        if pixel_values.dim() != 4 or pixel_values.shape[1:] != (
            a.num_channels, a.image_size, a.image_size
        ):  # fmt: skip
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}: expected "
                f"({self.takes}, {a.num_channels}, {a.image_size}, {a.image_size})"
            )
        weight = self.embeddings.patch_embedding.weight
        x = self.embeddings(pixel_values.to(weight.device, weight.dtype))
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from HF ``SiglipVisionModel`` tensors, named with or without
        its ``vision_model.`` prefix (copied in, cast to the weights' dtype, shapes
        checked); the head's tensors are ignored. ``ValueError`` naming the tensors
        missing."""
        sd = {k.removeprefix("vision_model."): v for k, v in sd.items()}
        load_encoder_tensors(self, sd, self.arch.num_layers, "vision tower")
