"""CLIP's vision encoder (ViT), as LLaVA reads it: the hidden states after chosen layers.

Pixels ``(num_images, channels, image_size, image_size)`` are cut into non-overlapping
``patch_size`` squares by a bias-free convolution; a learned class embedding (CLS) goes
first, learned position embeddings are added, then ``pre_layrnorm`` (HF's spelling) and the
pre-norm encoder layers (full bidirectional attention, an MLP of ``hidden_act``). Hidden
state ``k`` is the one after ``k`` layers (0: the normed embeddings), as in transformers'
``hidden_states``. Only the layers up to the deepest hidden state read are built, and no
``post_layernorm`` (LLaVA reads no pooled output); loading ignores the tensors of what is
not built. Tensors are named as HF's ``CLIPVisionModel`` names them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI CLIP's GELU approximation, ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


# HF's activation names (``hidden_act``, ``projector_hidden_act``): "gelu" is the exact one,
# "gelu_pytorch_tanh" (SigLIP's) torch's tanh approximation.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function of HF activation ``name``; ``ValueError`` naming the config ``field``
    that gave it when it is not supported."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{field} {name!r} is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of x (seq, heads, head_dim) in fp32, back in x's dtype, by
    (seq, head_dim) cos and sin: the vision towers' 2-D rotary (Qwen2-VL's, Pixtral's,
    Kimi K2.5's)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


@dataclass(frozen=True)
class CLIPVisionArch:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int  # the layers built: as many as the deepest hidden state read needs
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, config: Any, num_layers: int) -> CLIPVisionArch:
        """The arch of an HF ``CLIPVisionConfig`` (model_type ``clip_vision_model``), built
        up to ``num_layers`` of its ``num_hidden_layers`` layers."""
        if config.model_type != "clip_vision_model":
            raise ValueError(f"vision_config model_type {config.model_type!r} is not CLIP's")
        if not 0 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers {num_layers} is outside [0, {config.num_hidden_layers}]")
        return cls.of_config(config, num_layers)

    @classmethod
    def of_config(cls, config: Any, num_layers: int) -> Any:
        """The arch (of ``cls``) of a CLIP-shaped tower's HF config (CLIP's, SigLIP's,
        Idefics3's), ``num_layers`` of its layers built; ``ValueError`` naming the field
        for heads that do not divide the width or an unsupported activation."""
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"vision_config.hidden_size {config.hidden_size} is not a multiple of "
                f"num_attention_heads {config.num_attention_heads}"
            )
        activation(config.hidden_act, "vision_config.hidden_act")
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_layers=num_layers,
            image_size=config.image_size,
            patch_size=config.patch_size,
            num_channels=config.num_channels,
            layer_norm_eps=config.layer_norm_eps,
            hidden_act=config.hidden_act,
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side**2


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, a: CLIPVisionArch) -> None:
        super().__init__()
        self.a = a
        self.class_embedding = nn.Parameter(torch.empty(a.hidden_size))
        self.patch_embedding = nn.Conv2d(
            a.num_channels, a.hidden_size, a.patch_size, stride=a.patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(a.num_patches + 1, a.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_images, channels, size, size) -> (num_images, 1 + num_patches, hidden)."""
        patches = self.patch_embedding(pixel_values)  # (n, hidden, grid, grid)
        patches = patches.flatten(2).transpose(1, 2)  # (n, num_patches, hidden), row-major
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Multi-head self-attention over all positions, q/k/v fused into one projection."""

    def __init__(self, a: CLIPVisionArch) -> None:
        super().__init__()
        self.num_heads = a.num_heads
        self.qkv_proj = nn.Linear(a.hidden_size, 3 * a.hidden_size)
        self.out_proj = nn.Linear(a.hidden_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, seq, hidden = x.shape
        qkv = self.qkv_proj(x).view(n, seq, 3, self.num_heads, hidden // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (n, heads, seq, head_dim)
        out = F.scaled_dot_product_attention(q, k, v)  # scale 1 / sqrt(head_dim), as CLIP's
        return self.out_proj(out.transpose(1, 2).reshape(n, seq, hidden))


class CLIPMLP(nn.Module):
    def __init__(self, a: CLIPVisionArch) -> None:
        super().__init__()
        self.act = activation(a.hidden_act, "vision_config.hidden_act")
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, a: CLIPVisionArch) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.self_attn = CLIPAttention(a)
        self.layer_norm2 = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.mlp = CLIPMLP(a)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(num_images, seq, hidden) -> the same: pre-norm attention, then MLP, each added
        to the residual stream."""
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, a: CLIPVisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(a) for _ in range(a.num_layers))


class CLIPVisionModel(nn.Module):
    """The encoder up to ``arch.num_layers``; submodules named as HF's (``embeddings``,
    ``pre_layrnorm``, ``encoder.layers``), q/k/v fused (``load_weights`` fuses them)."""

    def __init__(self, arch: CLIPVisionArch) -> None:
        super().__init__()
        self.arch = arch
        self.embeddings = CLIPVisionEmbeddings(arch)
        self.pre_layrnorm = nn.LayerNorm(arch.hidden_size, eps=arch.layer_norm_eps)
        self.encoder = CLIPEncoder(arch)

    def forward(self, pixel_values: torch.Tensor, feature_layers: tuple[int, ...]) -> torch.Tensor:
        """(num_images, channels, image_size, image_size) pixels, in any float dtype ->
        (num_images, 1 + num_patches, hidden * len(feature_layers)) in the weights' dtype:
        hidden states ``feature_layers`` (each in [0, num_layers]) concatenated in that
        order on the last dimension, CLS first on the position dimension."""
        a = self.arch
        if pixel_values.shape[1:] != (a.num_channels, a.image_size, a.image_size):
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}: expected "
                f"(num_images, {a.num_channels}, {a.image_size}, {a.image_size})"
            )
        if not all(0 <= i <= a.num_layers for i in feature_layers):
            raise ValueError(f"feature_layers {feature_layers} outside [0, {a.num_layers}]")
        weight = self.embeddings.class_embedding
        x = self.pre_layrnorm(self.embeddings(pixel_values.to(weight.device, weight.dtype)))
        kept = {0: x} if 0 in feature_layers else {}
        for i, layer in enumerate(self.encoder.layers, start=1):
            x = layer(x)
            if i in feature_layers:
                kept[i] = x
        return torch.cat([kept[i] for i in feature_layers], dim=-1)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from HF ``CLIPVisionModel`` tensors, named with or without
        its ``vision_model.`` prefix (copied in, cast to the weights' dtype, shapes
        checked); tensors of layers not built and ``post_layernorm`` are ignored.
        ``ValueError`` naming the tensors missing."""
        sd = {k.removeprefix("vision_model."): v for k, v in sd.items()}
        load_encoder_tensors(self, sd, self.arch.num_layers, "vision tower")


def load_encoder_tensors(
    module: nn.Module, sd: dict[str, torch.Tensor], num_layers: int, what: str
) -> None:
    """Fill every parameter of a vision encoder built of ``CLIPEncoder`` layers from HF
    tensors named as its modules (each layer's ``q/k/v_proj`` fused into ``qkv_proj``);
    other tensors ignored. ``ValueError`` naming the tensors missing."""
    sd = dict(sd)
    for i in range(num_layers):
        p = f"encoder.layers.{i}.self_attn."
        for kind in ("weight", "bias"):
            parts = [sd.get(f"{p}{n}_proj.{kind}") for n in "qkv"]
            if all(t is not None for t in parts):
                sd[f"{p}qkv_proj.{kind}"] = torch.cat(parts)
    names = module.state_dict().keys()
    missing = sorted(names - sd.keys())
    if missing:
        raise ValueError(f"the checkpoint lacks {what} tensors {missing}")
    module.load_state_dict({k: sd[k] for k in names})
