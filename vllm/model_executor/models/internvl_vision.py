"""InternVL's vision tower (InternViT: transformers' ``InternVLVisionModel``), as
``InternVLForConditionalGeneration`` reads it: the hidden state after one chosen layer.

A tile ``(channels, image_size, image_size)`` is cut into non-overlapping ``patch_size``
squares by a convolution (with a bias); a learned CLS token goes first, and learned
absolute position embeddings are added (``use_absolute_position_embeddings``). Then the
pre-norm layers: ``layernorm_before`` (a LayerNorm or an RMSNorm: ``norm_type``), attention
(q/k/v with ``attention_bias``; q and k RMS-normed over the whole width with
``use_qk_norm``, eps 1e-6), scaled per channel by ``lambda_1`` (layer scale) and added to
the residual stream; ``layernorm_after``, the MLP of ``hidden_act``, scaled by
``lambda_2`` and added. Hidden state ``k`` is the one after ``k`` layers (0: the
embeddings), as transformers' ``hidden_states``; its ``last_hidden_state`` adds the tower's
``layernorm`` (a LayerNorm, whatever ``norm_type`` says) when ``use_mean_pooling`` is off.

transformers interpolates the position embeddings (bicubic) only for an input of another
patch count or a non-square one; the image processor's tiles always measure
``image_size``, so the tower takes only those (``ValueError`` otherwise). Only the layers up
to the one read are built; loading ignores the tensors of what is not built (and the
pre-training ``mask_token``). Tensors are named as transformers names the module
(``embeddings.``, ``encoder.layer.``, ``layernorm.``), q/k/v fused on load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.clip import (
    CLIPMLP,
    CLIPVisionArch,
    activation,
    load_encoder_tensors,
)
from vllm.model_executor.models.qwen2_vl_vision import VisionRMSNorm

MODEL_TYPE = "internvl_vision"
NORM_TYPES = ("layer_norm", "rms_norm")
QK_NORM_EPS = 1e-6  # transformers' InternVLVisionRMSNorm default: not layer_norm_eps


def _square(value: Any, field: str) -> int:
    """One side of a square ``image_size`` / ``patch_size`` (an int or an (h, w) pair)."""
    sides = tuple(value) if isinstance(value, (list, tuple)) else (value, value)
    if len(sides) != 2 or sides[0] != sides[1] or not isinstance(sides[0], int):
        raise ValueError(f"vision_config.{field} {value!r}: only square sizes are supported")
    return sides[0]


@dataclass(frozen=True)
class InternVLVisionArch(CLIPVisionArch):
    """CLIP's fields (``num_layers``: the layers built), and InternViT's."""

    norm_type: str = "layer_norm"
    qk_norm: bool = False
    attention_bias: bool = False
    absolute_positions: bool = True
    final_norm: bool = False  # the tower's ``layernorm`` after the last layer built

    @classmethod
    def from_hf(cls, config: Any, num_layers: int, final_norm: bool) -> InternVLVisionArch:
        """The arch of an HF ``InternVLVisionConfig``, built up to ``num_layers`` of its
        ``num_hidden_layers`` layers; ``final_norm``: its ``layernorm`` after them (only
        where ``use_mean_pooling`` is off: transformers' is an identity otherwise)."""
        if config.model_type != MODEL_TYPE:
            raise ValueError(f"vision_config model_type {config.model_type!r} is not {MODEL_TYPE}")
        if not 0 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers {num_layers} is outside [0, {config.num_hidden_layers}]")
        if config.norm_type not in NORM_TYPES:
            raise ValueError(
                f"vision_config.norm_type {config.norm_type!r} is not one of {NORM_TYPES}"
            )
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"vision_config.hidden_size {config.hidden_size} is not a multiple of "
                f"num_attention_heads {config.num_attention_heads}"
            )
        image = _square(config.image_size, "image_size")
        patch = _square(config.patch_size, "patch_size")
        if image % patch:
            raise ValueError(f"vision_config.image_size {image} is not a multiple of {patch}")
        activation(config.hidden_act, "vision_config.hidden_act")
        same = ("hidden_size", "intermediate_size", "num_channels", "layer_norm_eps", "hidden_act")
        return cls(
            **{name: getattr(config, name) for name in same},
            num_heads=config.num_attention_heads,
            num_layers=num_layers,
            image_size=image,
            patch_size=patch,
            norm_type=config.norm_type,
            qk_norm=bool(config.use_qk_norm),
            attention_bias=bool(config.attention_bias),
            absolute_positions=bool(config.use_absolute_position_embeddings),
            final_norm=final_norm and not config.use_mean_pooling,
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


def _norm(a: InternVLVisionArch) -> nn.Module:
    if a.norm_type == "rms_norm":
        return VisionRMSNorm(a.hidden_size, a.layer_norm_eps)
    return nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)


class InternVLVisionPatchEmbeddings(nn.Module):
    def __init__(self, a: InternVLVisionArch) -> None:
        super().__init__()
        self.projection = nn.Conv2d(a.num_channels, a.hidden_size, a.patch_size, a.patch_size)


class InternVLVisionEmbeddings(nn.Module):
    def __init__(self, a: InternVLVisionArch) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.empty(1, 1, a.hidden_size))
        self.patch_embeddings = InternVLVisionPatchEmbeddings(a)
        self.position_embeddings = None
        if a.absolute_positions:
            positions = a.patches_per_side**2 + 1
            self.position_embeddings = nn.Parameter(torch.empty(1, positions, a.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(tiles, channels, size, size) -> (tiles, 1 + num_patches, hidden), CLS first."""
        patches = self.patch_embeddings.projection(pixel_values)  # (n, hidden, grid, grid)
        patches = patches.flatten(2).transpose(1, 2)  # (n, num_patches, hidden), row-major
        x = torch.cat([self.cls_token.expand(patches.shape[0], -1, -1), patches], dim=1)
        return x if self.position_embeddings is None else x + self.position_embeddings


class InternVLVisionAttention(nn.Module):
    """Multi-head self-attention over all positions, q/k/v fused into one projection, q and
    k optionally RMS-normed over the whole width before the heads are split."""

    def __init__(self, a: InternVLVisionArch) -> None:
        super().__init__()
        d = a.hidden_size
        self.num_heads = a.num_heads
        self.qkv_proj = nn.Linear(d, 3 * d, bias=a.attention_bias)
        self.q_norm = VisionRMSNorm(d, QK_NORM_EPS) if a.qk_norm else nn.Identity()
        self.k_norm = VisionRMSNorm(d, QK_NORM_EPS) if a.qk_norm else nn.Identity()
        self.projection_layer = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, d = x.shape
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(n, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)  # (n, heads, seq, head_dim)
        return self.projection_layer(out.transpose(1, 2).reshape(n, seq, d))


class InternVLVisionLayer(nn.Module):
    def __init__(self, a: InternVLVisionArch) -> None:
        super().__init__()
        self.layernorm_before = _norm(a)
        self.attention = InternVLVisionAttention(a)
        self.lambda_1 = nn.Parameter(torch.empty(a.hidden_size))
        self.layernorm_after = _norm(a)
        self.mlp = CLIPMLP(a)  # fc1, hidden_act, fc2: transformers' InternVLVisionMLP
        self.lambda_2 = nn.Parameter(torch.empty(a.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(tiles, seq, hidden) -> the same: each branch scaled per channel (layer scale)
        before it joins the residual stream."""
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class InternVLVisionEncoder(nn.Module):
    def __init__(self, a: InternVLVisionArch) -> None:
        super().__init__()
        self.layer = nn.ModuleList(InternVLVisionLayer(a) for _ in range(a.num_layers))


class InternVLVisionModel(nn.Module):
    """The tower up to ``arch.num_layers`` (and its ``layernorm`` with
    ``arch.final_norm``); submodules named as transformers' (module docstring)."""

    def __init__(self, arch: InternVLVisionArch) -> None:
        super().__init__()
        self.arch = arch
        self.embeddings = InternVLVisionEmbeddings(arch)
        self.encoder = InternVLVisionEncoder(arch)
        if arch.final_norm:
            self.layernorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(tiles, channels, image_size, image_size) pixels in any float dtype -> (tiles,
        1 + num_patches, hidden) in the weights' dtype: the hidden state after
        ``num_layers`` layers (then ``layernorm`` with ``final_norm``), CLS first.
        ``ValueError`` for tiles of another shape."""
        a = self.arch
        if pixel_values.dim() != 4 or pixel_values.shape[1:] != (
            a.num_channels, a.image_size, a.image_size
        ):  # fmt: skip
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}: expected tiles of "
                f"(num_tiles, {a.num_channels}, {a.image_size}, {a.image_size})"
            )
        weight = self.embeddings.patch_embeddings.projection.weight
        x = self.embeddings(pixel_values.to(weight.device, weight.dtype))
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x) if a.final_norm else x

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from transformers' ``InternVLVisionModel`` tensors, named
        without the model's ``vision_tower.`` prefix (each layer's ``attention.q/k/v_proj``
        fused into ``qkv_proj``; copied in, cast to the weights' dtype, shapes checked);
        others ignored. ``ValueError`` naming the tensors missing."""
        sd = dict(sd)
        for i in range(self.arch.num_layers):
            attention = f"encoder.layer.{i}.attention."
            for kind in ("weight", "bias"):
                parts = [sd.get(f"{attention}{name}_proj.{kind}") for name in "qkv"]
                if all(part is not None for part in parts):
                    sd[f"{attention}qkv_proj.{kind}"] = torch.cat(parts)
        # Fused above: no layer of CLIP's names for it to fuse.
        load_encoder_tensors(self, sd, 0, "vision tower")
