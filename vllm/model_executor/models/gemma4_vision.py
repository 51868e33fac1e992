"""Gemma 4's vision tower and its embedder into the language model (transformers'
``Gemma4VisionModel`` and ``Gemma4MultimodalEmbedder``, as ``Gemma4Model.get_image_features``
chains them), for images at their own size.

An image comes as its patches: transformers' ``Gemma4ImageProcessor`` resizes it, keeping
its aspect ratio, to ``h x w`` patches of ``patch_size`` pixels (both multiples of
``pooling_kernel_size``), rescales to [0, 1] and flattens each patch (rows of pixels, each
pixel's channels last: ``3 * patch_size ** 2`` values), row-major; its padding patches
(position ``(-1, -1)``) are left out here. The tower:

- patch embedding: ``input_proj(2 * (pixels - 0.5))`` (no bias) plus two learned position
  tables, the patch's column's row of the first and its row's of the second;
- encoder layers, every patch attending to every patch of its image: Gemma 4's sandwich
  norms (RMS, ``x * weight``, fp32), q and k RMS-normed per head, v per head without a
  weight, unscaled attention (1.0), a 2-D rotation (``axial``: the head's first half turned
  by the patch's column, its second half by its row, each as a rotate-half rotation with
  ``head_dim / 4`` frequencies of ``rope_theta``); a gated GeLU-tanh MLP; with
  ``use_clipped_linears``, each projection's input and output clamped to its checkpoint's
  bounds;
- pooling: the ``h x w`` grid averaged over ``pooling_kernel_size`` squares (in fp32,
  rounded to the weights' dtype), times ``sqrt(hidden_size)`` in fp32, with ``standardize``
  ``(x - std_bias) * std_scale``: ``h * w / k ** 2`` rows, row-major;
- the embedder: RMS-normed without a weight, projected to the language model's width.

Tensors are named as transformers names them under ``model.vision_tower.`` and
``model.embed_vision.``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vllm.model_executor.models.gemma4 import _GELU_TANH, Gemma4RMSNorm

MODEL_TYPE = "gemma4_vision"
TOWER_PREFIX = "model.vision_tower."
EMBEDDER_PREFIX = "model.embed_vision."


@dataclass(frozen=True)
class Gemma4VisionArch:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    rms_norm_eps: float
    rope_theta: float
    text_hidden_size: int  # the embedder's output: the language model's width
    standardize: bool = False
    use_clipped_linears: bool = False

    @classmethod
    def from_hf(cls, config: Any, text_hidden_size: int) -> Gemma4VisionArch:
        """The arch of a ``Gemma4VisionConfig``; ``ValueError`` naming the field it cannot
        serve."""
        if config.model_type != MODEL_TYPE:
            raise ValueError(f"vision_config model_type {config.model_type!r} is not {MODEL_TYPE}")
        act = getattr(config, "hidden_activation", None)
        if act not in _GELU_TANH:
            raise ValueError(
                f"vision_config.hidden_activation {act!r} is not supported (gelu_pytorch_tanh)"
            )
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_type {rope.get('rope_type')!r}: only 'axial'")
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if heads % kv_heads or head_dim % 4:
            raise ValueError(
                f"vision_config: {kv_heads} KV heads do not divide {heads} heads, or head_dim "
                f"{head_dim} is not a multiple of 4 (two axes of rotate-half pairs)"
            )
        for field in ("patch_size", "pooling_kernel_size", "position_embedding_size"):
            value = getattr(config, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"vision_config.{field} {value!r}: one positive int")
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            patch_size=config.patch_size,
            pooling_kernel_size=config.pooling_kernel_size,
            position_embedding_size=config.position_embedding_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", 100.0)),
            text_hidden_size=text_hidden_size,
            standardize=bool(getattr(config, "standardize", False)),
            use_clipped_linears=bool(getattr(config, "use_clipped_linears", False)),
        )


class ClippableLinear(nn.Module):
    """A linear layer without a bias; with ``clipped``, its input and output clamped to
    the checkpoint's ``input_min``/``input_max`` and ``output_min``/``output_max``."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                self.register_buffer(name, torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return self.linear(x)
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(self.linear(x), self.output_min, self.output_max)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotation of x (..., n) by (tokens, 1, n) cos and sin."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Gemma4VisionLayer(nn.Module):
    def __init__(self, a: Gemma4VisionArch) -> None:
        super().__init__()
        self.a = a
        clip, h, d = a.use_clipped_linears, a.hidden_size, a.head_dim
        self.q_proj = ClippableLinear(h, a.num_heads * d, clip)
        self.k_proj = ClippableLinear(h, a.num_kv_heads * d, clip)
        self.v_proj = ClippableLinear(h, a.num_kv_heads * d, clip)
        self.o_proj = ClippableLinear(a.num_heads * d, h, clip)
        eps = a.rms_norm_eps
        self.q_norm = Gemma4RMSNorm(d, eps)
        self.k_norm = Gemma4RMSNorm(d, eps)
        self.v_norm = Gemma4RMSNorm(d, eps, scale=False)
        self.gate_proj = ClippableLinear(h, a.intermediate_size, clip)
        self.up_proj = ClippableLinear(h, a.intermediate_size, clip)
        self.down_proj = ClippableLinear(a.intermediate_size, h, clip)
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # fmt: skip
            setattr(self, name, Gemma4RMSNorm(h, eps))

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """(patches, hidden) of one image -> (patches, hidden): every patch sees every one."""
        a, d = self.a, self.a.head_dim
        (cos_x, sin_x), (cos_y, sin_y) = rope
        half = d // 2

        def turn(t: torch.Tensor) -> torch.Tensor:  # columns turn the first half, rows the rest
            return torch.cat(
                (_rotate(t[..., :half], cos_x, sin_x), _rotate(t[..., half:], cos_y, sin_y)),
                dim=-1,
            )

        q = turn(self.q_norm(self.q_proj(x).view(-1, a.num_heads, d)))
        k = turn(self.k_norm(self.k_proj(x).view(-1, a.num_kv_heads, d)))
        v = self.v_norm(self.v_proj(x).view(-1, a.num_kv_heads, d))
        if a.num_kv_heads != a.num_heads:
            groups = a.num_heads // a.num_kv_heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0
        )
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.attention(self.input_layernorm(x), rope))
        h = self.pre_feedforward_layernorm(x)
        h = self.down_proj(F.gelu(self.gate_proj(h), approximate="tanh") * self.up_proj(h))
        return x + self.post_feedforward_layernorm(h)


class Gemma4VisionModel(nn.Module):
    """The tower and the embedder (module docstring): ``forward(patches, grids)`` -> the
    images' rows in the language model's width."""

    def __init__(self, a: Gemma4VisionArch) -> None:
        super().__init__()
        self.arch = a
        self.input_proj = nn.Linear(3 * a.patch_size**2, a.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.zeros(2, a.position_embedding_size, a.hidden_size)
        )
        self.layers = nn.ModuleList(Gemma4VisionLayer(a) for _ in range(a.num_layers))
        if a.standardize:
            self.register_buffer("std_bias", torch.zeros(a.hidden_size))
            self.register_buffer("std_scale", torch.ones(a.hidden_size))
        self.embedding_projection = nn.Linear(a.hidden_size, a.text_hidden_size, bias=False)
        self.embedding_norm = Gemma4RMSNorm(a.hidden_size, a.rms_norm_eps, scale=False)

    def _rope(self, height: int, width: int, dtype, device):
        """Per axis (columns, rows): cos and sin (patches, 1, head_dim / 2) of each patch."""
        a = self.arch
        quarter = a.head_dim // 4
        inv_freq = 1.0 / (
            a.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float) / (2 * quarter))
        ).to(device)
        rows = torch.arange(height, device=device).repeat_interleave(width)
        cols = torch.arange(width, device=device).repeat(height)
        out = []
        for pos in (cols, rows):
            angles = pos[:, None].float() * inv_freq
            angles = torch.cat((angles, angles), dim=-1)[:, None]
            out.append((angles.cos().to(dtype), angles.sin().to(dtype)))
        return out

    def encode(self, patches: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """One image's (height * width, 3 * patch_size ** 2) patches, row-major ->
        (height * width / k ** 2, text hidden) rows."""
        a, k = self.arch, self.arch.pooling_kernel_size
        if height % k or width % k or max(height, width) > a.position_embedding_size:
            raise ValueError(
                f"an image of {height} x {width} patches: each side must be a multiple of "
                f"pooling_kernel_size {k} and at most position_embedding_size "
                f"{a.position_embedding_size}"
            )
        if patches.shape != (height * width, 3 * a.patch_size**2):
            raise ValueError(
                f"patches of shape {tuple(patches.shape)} for {height} x {width} patches of "
                f"{3 * a.patch_size**2} values"
            )
        weight = self.input_proj.weight
        px = 2 * (patches.to(weight.device, torch.float32) - 0.5)
        x = self.input_proj(px.to(weight.dtype))
        table = self.position_embedding_table
        x = x + (table[0, :width].repeat(height, 1) + table[1, :height].repeat_interleave(width, 0))
        rope = self._rope(height, width, x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, rope)
        grid = x.float().view(height // k, k, width // k, k, -1)
        pooled = grid.mean(dim=(1, 3)).reshape(-1, a.hidden_size).to(x.dtype)
        pooled = pooled.float() * math.sqrt(a.hidden_size)
        if a.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return self.embedding_projection(self.embedding_norm(pooled.to(x.dtype)))

    def forward(self, patches: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """The images' patches concatenated (patches, 3 * patch_size ** 2), any float
        dtype, any device, and their (images, 3) grids (1, height, width) -> their rows
        concatenated, in the weights' dtype, on their device."""
        out, start = [], 0
        for t, h, w in grids.tolist():
            if t != 1:
                raise ValueError(f"a grid of {t} frames: Gemma 4 takes images one frame each")
            out.append(self.encode(patches[start : start + h * w], h, w))
            start += h * w
        if start != patches.shape[0]:
            raise ValueError(f"{patches.shape[0]} patches for grids of {start}")
        return torch.cat(out)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy transformers' tensors (``model.vision_tower.``, ``model.embed_vision.``) in;
        ``ValueError`` naming the tensors missing. A clipped linear's bound the checkpoint
        lacks is infinite (no clamp), as transformers initializes it."""
        a = self.arch
        bounds = {}  # ours -> (theirs, the value when missing)
        names = {
            "input_proj.weight": TOWER_PREFIX + "patch_embedder.input_proj.weight",
            "position_embedding_table": TOWER_PREFIX + "patch_embedder.position_embedding_table",
            "embedding_projection.weight": EMBEDDER_PREFIX + "embedding_projection.weight",
        }
        if a.standardize:
            names["std_bias"] = TOWER_PREFIX + "std_bias"
            names["std_scale"] = TOWER_PREFIX + "std_scale"
        linears = {"q_proj": "self_attn.", "k_proj": "self_attn.", "v_proj": "self_attn.",
                   "o_proj": "self_attn.", "gate_proj": "mlp.", "up_proj": "mlp.",
                   "down_proj": "mlp."}  # fmt: skip
        for i in range(a.num_layers):
            ours, theirs = f"layers.{i}.", f"{TOWER_PREFIX}encoder.layers.{i}."
            for name, part in linears.items():
                names[f"{ours}{name}.linear.weight"] = f"{theirs}{part}{name}.linear.weight"
                if a.use_clipped_linears:
                    for bound in ("input_min", "input_max", "output_min", "output_max"):
                        inf = -math.inf if bound.endswith("min") else math.inf
                        bounds[f"{ours}{name}.{bound}"] = (f"{theirs}{part}{name}.{bound}", inf)
            for name in ("q_norm", "k_norm"):
                names[f"{ours}{name}.weight"] = f"{theirs}self_attn.{name}.weight"
            for name in ("input_layernorm", "post_attention_layernorm",
                         "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # fmt: skip
                names[f"{ours}{name}.weight"] = f"{theirs}{name}.weight"
        missing = [theirs for theirs in names.values() if theirs not in sd]
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:3]}: a "
                "Gemma 4 checkpoint with a vision_config needs its tower and embed_vision"
            )
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        with torch.no_grad():
            for ours, theirs in names.items():
                own[ours].copy_(sd[theirs].reshape(own[ours].shape))
            for ours, (theirs, missing_value) in bounds.items():
                if theirs in sd:
                    own[ours].copy_(sd[theirs].reshape(()))
                else:
                    own[ours].fill_(missing_value)
