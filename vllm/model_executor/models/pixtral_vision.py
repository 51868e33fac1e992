"""Pixtral's vision encoder (transformers' ``PixtralVisionModel``), as Mistral 3 reads it.

Each image keeps its own size (H x W pixels, multiples of ``patch_size``: no padding, no
crop): a bias-free convolution cuts it into ``patch_size`` squares, an (H / p) x (W / p)
grid of patches taken row-major; ``ln_pre`` (RMSNorm), then pre-norm blocks
(``attention_norm``, attention, ``ffn_norm``, the gated feed-forward ``down(act(gate(x)) *
up(x))`` of ``hidden_act``; no biases anywhere; norms of eps 1e-5). Attention is
bidirectional within each image, never across images, and rotates q and k by the patch's
(row, column): Pixtral's 2D rotary takes the head's ``head_dim / 2`` frequencies
``rope_theta ** (-2i / head_dim)``, turns the even ones by the row and the odd ones by the
column, and lays the angles out ``[rows' | columns']``, twice (rotate_half: the checkpoint
converter permuted q and k for it). Hidden state k is the one after k blocks (0:
``ln_pre``'s output), as in transformers' ``hidden_states``; only the blocks up to the one
read are built, and loading ignores the others' tensors.

Tensors are named as transformers names them (``patch_conv.``, ``ln_pre.``,
``transformer.layers.N.``), without the model's ``vision_tower.`` prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.clip import activation, rotate
from vllm.model_executor.models.llama import RMSNorm

NORM_EPS = 1e-5  # transformers' Pixtral norms hard-code it


@dataclass(frozen=True)
class PixtralVisionArch:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int  # the blocks built: as many as the hidden state read needs
    patch_size: int
    num_channels: int
    hidden_act: str
    rope_theta: float

    @classmethod
    def from_hf(cls, config: Any, num_layers: int) -> PixtralVisionArch:
        """The arch of an HF ``PixtralVisionConfig`` (model_type ``pixtral``), built up to
        ``num_layers`` of its ``num_hidden_layers`` blocks."""
        if config.model_type != "pixtral":
            raise ValueError(f"vision_config model_type {config.model_type!r} is not pixtral")
        if not 0 <= num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers {num_layers} is outside [0, {config.num_hidden_layers}]")
        if not isinstance(config.patch_size, int):
            raise ValueError(f"vision_config.patch_size {config.patch_size!r}: one int")
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_type {rope['rope_type']!r}: only axial")
        activation(config.hidden_act, "vision_config.hidden_act")
        arch = cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_layers=num_layers,
            patch_size=config.patch_size,
            num_channels=config.num_channels,
            hidden_act=config.hidden_act,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )
        if arch.hidden_size % arch.num_heads or arch.head_dim % 4:
            raise ValueError(
                f"vision_config: width {arch.hidden_size} over {arch.num_heads} heads must give "
                "a head size that is a multiple of 4 (the 2D rotary's quarters)"
            )
        return arch

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def rotary_cos_sin(
    h: int, w: int, a: PixtralVisionArch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (h * w, head_dim) cos and sin of the 2D rotary for an h x w patch grid,
    row-major: angles ``[row * f[0::2] | col * f[1::2]]`` twice (module docstring)."""
    d = a.head_dim
    inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rows = torch.arange(h, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.float32).repeat(h)
    angles = torch.cat([rows[:, None] * inv_freq[0::2], cols[:, None] * inv_freq[1::2]], dim=-1)
    angles = torch.cat([angles, angles], dim=-1).to(device)  # (h * w, head_dim)
    return angles.cos(), angles.sin()


class PixtralAttention(nn.Module):
    def __init__(self, a: PixtralVisionArch) -> None:
        super().__init__()
        self.num_heads = a.num_heads
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(a.hidden_size, a.hidden_size, bias=False))

    def forward(self, x, cos, sin, lengths: list[int]) -> torch.Tensor:
        """(patches, hidden) of images of ``lengths`` patches, concatenated -> the same:
        each image attends to itself alone."""
        seq, hidden = x.shape
        q, k, v = (proj(x).view(seq, self.num_heads, -1) for proj in
                   (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            qi, ki, vi = (t.transpose(0, 1)[None] for t in (qi, ki, vi))  # (1, heads, n, d)
            out.append(F.scaled_dot_product_attention(qi, ki, vi)[0].transpose(0, 1))
        return self.o_proj(torch.cat(out).reshape(seq, hidden))


class PixtralMLP(nn.Module):
    def __init__(self, a: PixtralVisionArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.act = activation(a.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralAttentionLayer(nn.Module):
    def __init__(self, a: PixtralVisionArch) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(a.hidden_size, NORM_EPS)
        self.attention = PixtralAttention(a)
        self.ffn_norm = RMSNorm(a.hidden_size, NORM_EPS)
        self.feed_forward = PixtralMLP(a)

    def forward(self, x, cos, sin, lengths: list[int]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, a: PixtralVisionArch) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralAttentionLayer(a) for _ in range(a.num_layers))


class PixtralVisionModel(nn.Module):
    """The encoder (module docstring); submodules named as HF's."""

    def __init__(self, arch: PixtralVisionArch) -> None:
        super().__init__()
        self.arch = arch
        p = arch.patch_size
        self.patch_conv = nn.Conv2d(arch.num_channels, arch.hidden_size, p, stride=p, bias=False)
        self.ln_pre = RMSNorm(arch.hidden_size, NORM_EPS)
        self.transformer = PixtralTransformer(arch)

    def forward(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """(channels, H, W) pixels of each image (any float dtype, any device; H and W
        multiples of ``patch_size``, each image its own) -> ((patches, hidden) hidden state
        after the built blocks, in the weights' dtype on their device: each image's patches
        row-major, the images in order; each image's (rows, cols) patch grid).
        ``ValueError`` for an image whose sides are not multiples of the patch."""
        a, weight = self.arch, self.patch_conv.weight
        grids, patches, cos, sin = [], [], [], []
        for image in images:
            _, height, width = image.shape
            if height % a.patch_size or width % a.patch_size:
                raise ValueError(
                    f"an image of {height} x {width} pixels: the sides must be multiples of "
                    f"patch_size {a.patch_size}"
                )
            x = self.patch_conv(image.to(weight.device, weight.dtype)[None])[0]  # (hidden, h, w)
            grids.append(tuple(x.shape[1:]))
            patches.append(x.flatten(1).T)  # (h * w, hidden), row-major
            c, s = rotary_cos_sin(*x.shape[1:], a, weight.device)
            cos.append(c)
            sin.append(s)
        lengths = [h * w for h, w in grids]
        x, cos, sin = torch.cat(patches), torch.cat(cos), torch.cat(sin)
        x = self.ln_pre(x)
        for layer in self.transformer.layers:
            x = layer(x, cos, sin, lengths)
        return x, grids

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Fill every parameter from HF encoder tensors named without the model's
        ``vision_tower.`` prefix (copied in, cast to the weights' dtype, shapes checked);
        other tensors (the blocks not built) are ignored. ``ValueError`` naming the tensors
        missing."""
        names = self.state_dict().keys()
        missing = sorted(names - sd.keys())
        if missing:
            raise ValueError(f"the checkpoint lacks vision tower tensors {missing}")
        self.load_state_dict({k: sd[k] for k in names})
