"""The vision transformers of Qwen2-VL and Qwen2.5-VL (transformers'
``Qwen2VisionTransformerPretrainedModel`` and ``Qwen2_5_VisionTransformerPretrainedModel``),
the pieces Qwen3-VL's tower (``qwen3_vl_vision.py``) shares with them, and the arch of a
Qwen-VL model that takes images (``QwenVLArch``: the language model's, its M-RoPE's and
the tower's).

The image processor resizes an image to a multiple of ``patch_size * spatial_merge_size``
pixels a side and flattens it into patches: ``pixel_values`` (patches, channels *
temporal_patch_size * patch_size ** 2), an image's ``t * h * w`` patches in merge-block
order (each ``spatial_merge_size`` x ``spatial_merge_size`` block of patches consecutive,
the blocks row-major), ``image_grid_thw`` its (t, h, w) in patches (t = 1 for an image: its
one frame repeated over the temporal patch). The tower embeds each patch (a Conv3d whose
kernel is the whole patch: one matmul), runs pre-norm blocks whose attention rotates q and
k by the patch's (row, column) (the 2D rotary: the first half of each head's rotary
frequencies by the row, the second by the column), and the patch merger concatenates each
merge block's patches into one row projected to the language model's width: ``t * h * w /
spatial_merge_size ** 2`` rows an image, in order.

Qwen2-VL: LayerNorm blocks, an MLP of ``hidden_act`` (quick_gelu), attention over all
the patches of one frame. Qwen2.5-VL: RMSNorm blocks, a SwiGLU MLP with biases, attention
within each window of ``window_size`` pixels a side (a window's merge blocks made
consecutive by reordering them, the reorder undone after the merger) except in the
``fullatt_block_indexes`` blocks, which attend over the whole frame as Qwen2-VL's.
Qwen3-VL: ``qwen3_vl_vision.py`` (a learned position table, deepstack features); Qwen3-VL-MoE
has Qwen3-VL's tower.

Tensors are named as transformers names the tower (``patch_embed.``, ``blocks.N.``,
``merger.``), without the model's ``visual.`` prefix.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.clip import ACTIVATIONS, rotate
from vllm.model_executor.models.llama import LlamaArch
from vllm.model_executor.models.utils import config_from_dict

# The top-level model types whose tower is built (every Qwen-VL model served here).
IMAGE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
QWEN2_VL, QWEN2_5_VL, QWEN3_VL = "qwen2_vl_vision", "qwen2_5_vl_vision", "qwen3_vl_vision"
# The vision_config model types of Qwen3-VL's tower (Qwen3-VL-MoE's is the same tower).
QWEN3_VL_VISION_TYPES = (QWEN3_VL, "qwen3_vl_moe_vision")
# The model types with Qwen3-VL's interleaved M-RoPE.
QWEN3_VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# transformers' M-RoPE sections where the text config's rope parameters name none.
MROPE_SECTIONS = {
    "qwen2_vl": (16, 24, 24), "qwen2_5_vl": (16, 24, 24), "qwen3_vl": (24, 20, 20),
    "qwen3_vl_moe": (24, 20, 20),
}  # fmt: skip
NORM_EPS = 1e-6  # transformers' blocks and merger hard-code it
# One attention call per group of equal-length segments: (their rows' indices, count, length).
SegmentPlan = list[tuple[torch.Tensor, int, int]]


def _model_type(hf_config: Any) -> str | None:
    return hf_config.get("model_type") if isinstance(hf_config, dict) else hf_config.model_type


def takes_images(hf_config: Any) -> bool:
    """Whether a Qwen-VL config (transformers' or the dict of its config.json) is one whose
    images this engine encodes: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE."""
    return _model_type(hf_config) in IMAGE_MODEL_TYPES


def _config(hf_config: Any) -> Any:
    classes = {"qwen2_vl": "Qwen2VLConfig", "qwen2_5_vl": "Qwen2_5_VLConfig",
               "qwen3_vl": "Qwen3VLConfig", "qwen3_vl_moe": "Qwen3VLMoeConfig"}  # fmt: skip
    return config_from_dict(hf_config, classes)


def qwen_vl_image_layout(hf_config: Any) -> tuple[int, int]:
    """(the ``<|image_pad|>`` token id, ``spatial_merge_size``) of a Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL or Qwen3-VL-MoE config (transformers' or the dict of its config.json). An image
    of ``image_grid_thw`` (t, h, w) patches takes ``t * h * w // spatial_merge_size ** 2``
    of those tokens. ``ValueError`` for another model type."""
    if not takes_images(hf_config):
        raise ValueError(
            f"model_type {_model_type(hf_config)!r}: images are served for "
            f"{' and '.join(IMAGE_MODEL_TYPES)} only"
        )
    config = _config(hf_config)
    return config.image_token_id, config.vision_config.spatial_merge_size


@dataclass(frozen=True)
class QwenVisionArch:
    model_type: str  # QWEN2_VL, QWEN2_5_VL (or QWEN3_VL: qwen3_vl_vision.Qwen3VisionArch)
    hidden_size: int  # the blocks' width (Qwen2-VL's ``embed_dim``)
    out_hidden_size: int  # the merger's output: the language model's width
    intermediate_size: int
    num_heads: int
    depth: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    rope_theta: float
    # Qwen2.5-VL: a window's side in pixels, and the blocks that attend over whole frames.
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, config: Any) -> QwenVisionArch:
        """The arch of an HF ``Qwen2VLVisionConfig`` or ``Qwen2_5_VLVisionConfig``."""
        kind = config.model_type
        if kind not in (QWEN2_VL, QWEN2_5_VL):
            raise ValueError(f"vision_config model_type {kind!r} is not {QWEN2_VL} or {QWEN2_5_VL}")
        rope_theta = cls.check_patch_and_rope(config)
        qwen2 = kind == QWEN2_VL
        width = config.embed_dim if qwen2 else config.hidden_size
        arch = cls(
            model_type=kind,
            hidden_size=width,
            out_hidden_size=config.hidden_size if qwen2 else config.out_hidden_size,
            intermediate_size=int(width * config.mlp_ratio) if qwen2 else config.intermediate_size,
            num_heads=config.num_heads,
            depth=config.depth,
            hidden_act=config.hidden_act,
            in_channels=config.in_channels,
            patch_size=config.patch_size,
            temporal_patch_size=config.temporal_patch_size,
            spatial_merge_size=config.spatial_merge_size,
            rope_theta=rope_theta,
            window_size=0 if qwen2 else config.window_size,
            fullatt_block_indexes=() if qwen2 else tuple(config.fullatt_block_indexes),
        )
        arch.validate()
        return arch

    @staticmethod
    def check_patch_and_rope(config: Any) -> float:
        """The 2D rotary's theta of a ``vision_config``; ``ValueError`` unless its patch
        sizes are single ints and its rotary axial."""
        for field in ("patch_size", "temporal_patch_size"):
            if not isinstance(getattr(config, field), int):
                raise ValueError(f"vision_config.{field} {getattr(config, field)!r}: one int")
        rope = dict(config.rope_parameters or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_type {rope['rope_type']!r}: only axial")
        return float(rope.get("rope_theta", 10000.0))

    def validate(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"vision_config.hidden_act {self.hidden_act!r} is not supported "
                f"({', '.join(ACTIVATIONS)})"
            )
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision_config: width {self.hidden_size} over {self.num_heads} heads must "
                "give a head size that is a multiple of 4 (the 2D rotary's quarters)"
            )
        if self.windowed and self.window_units < 1:
            raise ValueError(
                f"vision_config.window_size {self.window_size} is under one merge block "
                f"({self.patch_size * self.spatial_merge_size} pixels)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_bias(self) -> bool:
        """Whether the patch embedding's Conv3d has a bias (Qwen3-VL's)."""
        return False

    @property
    def windowed(self) -> bool:
        """Qwen2.5-VL's blocks: RMSNorm, SwiGLU, window attention."""
        return self.model_type == QWEN2_5_VL

    @property
    def merge_unit(self) -> int:
        """Patches in one merged row."""
        return self.spatial_merge_size**2

    @property
    def window_units(self) -> int:
        """A window's side in merge blocks."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def vision_arch(config: Any) -> QwenVisionArch:
    """The arch of the tower of a Qwen-VL ``vision_config`` (transformers')."""
    if config.model_type in QWEN3_VL_VISION_TYPES:  # its module builds on this one: imported late
        from vllm.model_executor.models.qwen3_vl_vision import Qwen3VisionArch

        return Qwen3VisionArch.from_hf(config)
    return QwenVisionArch.from_hf(config)


@dataclass(frozen=True)
class QwenVLArch(LlamaArch):
    """A Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE model's arch: the language model's,
    its M-RoPE sections and the vision tower's."""

    # None only as a dataclass default (fields after LlamaArch's need one): from_text sets it.
    vision: QwenVisionArch | None = None
    # Per rotary frequency (the first rot_dim / 2), how many read the temporal, height and
    # width position: contiguous runs in turn, or interleaved (``mrope_axes``).
    mrope_section: tuple[int, ...] = (16, 24, 24)
    mrope_interleaved: bool = False  # Qwen3-VL's layout

    @classmethod
    def from_text(cls, text: LlamaArch, config: Any) -> QwenVLArch:
        """``text`` (the language model's arch: each of its fields, a field of ``cls``) with
        the tower of ``config`` (a transformers ``Qwen2VLConfig``, ``Qwen2_5_VLConfig``,
        ``Qwen3VLConfig`` or ``Qwen3VLMoeConfig``). ``ValueError`` when the M-RoPE sections
        do not cover the rotary frequencies. Qwen3-VL's M-RoPE is interleaved whatever its
        config's ``mrope_interleaved`` says (transformers does not read the flag)."""
        from vllm.model_executor.layers.rotary_embedding import rotary_dim

        model_type = _model_type(config)
        section = tuple(text.rope.get("mrope_section") or MROPE_SECTIONS[model_type])
        half = rotary_dim(text.head_dim, text.rope) // 2
        if len(section) != 3 or sum(section) != half:
            raise ValueError(
                f"rope mrope_section {list(section)}: three sections summing to the "
                f"{half} rotary frequencies"
            )
        vision = vision_arch(config.vision_config)
        if vision.out_hidden_size != text.hidden_size:
            raise ValueError(
                f"the vision merger's output width {vision.out_hidden_size} is not the "
                f"language model's {text.hidden_size}"
            )
        base = {f.name: getattr(text, f.name) for f in fields(text)}
        interleaved = model_type in QWEN3_VL_MODEL_TYPES
        return cls(**base, vision=vision, mrope_section=section, mrope_interleaved=interleaved)

    @property
    def mrope_axes(self) -> tuple[int, ...]:
        """Per rotary frequency, which position rotates it (0, 1, 2: temporal, height,
        width): ``mrope_section``'s contiguous runs (Qwen2-VL, Qwen2.5-VL), or interleaved
        (Qwen3-VL and Qwen3-VL-MoE, transformers' ``apply_interleaved_mrope``): frequency j
        reads the height where j % 3 == 1 and j < 3 * section[1], the width where
        j % 3 == 2 and j < 3 * section[2], else the temporal position."""
        s = self.mrope_section
        if not self.mrope_interleaved:
            return tuple(k for k, n in enumerate(s) for _ in range(n))
        return tuple(j % 3 if j % 3 and j < 3 * s[j % 3] else 0 for j in range(sum(s)))


def grid_list(grid_thw: torch.Tensor, merge: int) -> list[tuple[int, int, int]]:
    """The images' (t, h, w) patch grids on the host; ``ValueError`` unless each side is a
    positive multiple of ``merge``."""
    grids = [tuple(int(n) for n in row) for row in grid_thw.reshape(-1, 3).tolist()]
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(
                f"image grid (t, h, w) = {(t, h, w)}: h and w must be positive multiples of "
                f"spatial_merge_size {merge}"
            )
    return grids


def patch_rows_cols(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(patches, 2) (row, column) of each patch in the images' merge-block order."""
    out = []
    for t, h, w in grids:
        shape = (h // merge, w // merge, merge, merge)  # (block row, block col, i, j)
        rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(shape)
        cols = torch.arange(w).view(1, w // merge, 1, merge).expand(shape)
        out.append(torch.stack([rows.flatten(), cols.flatten()], dim=-1).repeat(t, 1))
    return torch.cat(out)


def rotary_cos_sin(
    rows_cols: torch.Tensor, a: QwenVisionArch, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (patches, head_dim) cos and sin of the 2D rotary: angles ``[row * f | col * f]``
    (f: head_dim / 4 frequencies of ``rope_theta`` over head_dim / 2), twice (rotate_half)."""
    half = a.head_dim // 2
    inv_freq = 1.0 / (a.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    angles = rows_cols.to(device).float()[:, :, None] * inv_freq.to(device)  # (n, 2, half / 2)
    angles = angles.flatten(1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def frame_bounds(grids: list[tuple[int, int, int]]) -> list[int]:
    """Boundaries of the patches of each frame of each image (the full-attention segments)."""
    bounds = [0]
    for t, h, w in grids:
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def window_order(
    grids: list[tuple[int, int, int]], merge: int, units: int
) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's window reordering: the merged rows (merge blocks) of each frame taken
    window by window (windows of ``units`` x ``units`` blocks, row-major over the frame,
    the last row and column of windows cut short), row-major within a window; and the
    windows' boundaries in patches of the reordered sequence."""
    order, bounds, base = [], [0], 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        ids = torch.arange(t * gh * gw).view(t, gh, gw) + base
        for frame in ids:
            for r in range(0, gh, units):
                for c in range(0, gw, units):
                    window = frame[r : r + units, c : c + units].flatten()
                    order.append(window)
                    bounds.append(bounds[-1] + window.numel() * merge * merge)
        base += t * gh * gw
    return torch.cat(order), bounds


def segment_plan(bounds: list[int], device: torch.device) -> SegmentPlan:
    """The segments ``[bounds[i], bounds[i + 1])`` grouped by length, for ``attend``."""
    starts: dict[int, list[int]] = defaultdict(list)
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if hi > lo:
            starts[hi - lo].append(lo)
    plan = []
    for length, los in starts.items():
        rows = torch.tensor(los)[:, None] + torch.arange(length)
        plan.append((rows.flatten().to(device), len(los), length))
    return plan


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan) -> torch.Tensor:
    """Bidirectional attention of q, k, v (seq, heads, head_dim) within each segment of
    ``plan`` (every row in one), scaled by 1 / sqrt(head_dim): (seq, heads, head_dim)."""
    out = torch.empty_like(q)
    heads, dim = q.shape[1:]
    for rows, count, length in plan:
        qs, ks, vs = (x[rows].view(count, length, heads, dim).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs)  # (count, heads, length, dim)
        out[rows] = o.transpose(1, 2).reshape(count * length, heads, dim)
    return out


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2.5-VL RMSNorm: normalised in fp32, cast back, then scaled."""

    def __init__(self, dim: int, eps: float = NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def make_norm(a: QwenVisionArch, dim: int) -> nn.Module:
    return VisionRMSNorm(dim) if a.windowed else nn.LayerNorm(dim, eps=NORM_EPS)


class QwenVisionPatchEmbed(nn.Module):
    """The Conv3d of transformers (its ``proj.weight``, kernel = stride = one patch) as the
    matmul it amounts to over flattened patches."""

    def __init__(self, a: QwenVisionArch) -> None:
        super().__init__()
        kernel = (a.temporal_patch_size, a.patch_size, a.patch_size)
        self.proj = nn.Conv3d(
            a.in_channels, a.hidden_size, kernel, stride=kernel, bias=a.patch_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(patches, channels * temporal * patch * patch) -> (patches, hidden)."""
        weight = self.proj.weight
        return F.linear(x, weight.view(weight.shape[0], -1), self.proj.bias)


class QwenVisionAttention(nn.Module):
    def __init__(self, a: QwenVisionArch) -> None:
        super().__init__()
        self.num_heads = a.num_heads
        self.qkv = nn.Linear(a.hidden_size, 3 * a.hidden_size)
        self.proj = nn.Linear(a.hidden_size, a.hidden_size)

    def forward(self, x, cos, sin, plan: SegmentPlan) -> torch.Tensor:
        seq, hidden = x.shape
        q, k, v = self.qkv(x).view(seq, 3, self.num_heads, -1).unbind(1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return self.proj(attend(q, k, v, plan).reshape(seq, hidden))


class Qwen2VisionMLP(nn.Module):
    def __init__(self, a: QwenVisionArch) -> None:
        super().__init__()
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.act = ACTIVATIONS[a.hidden_act]
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2_5VisionMLP(nn.Module):
    """SwiGLU with biases (``hidden_act``: silu in the checkpoints)."""

    def __init__(self, a: QwenVisionArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size)
        self.act = ACTIVATIONS[a.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class QwenVisionBlock(nn.Module):
    """``mlp``: the block's MLP where the family's is not Qwen2-VL's or Qwen2.5-VL's."""

    def __init__(self, a: QwenVisionArch, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = make_norm(a, a.hidden_size)
        self.norm2 = make_norm(a, a.hidden_size)
        self.attn = QwenVisionAttention(a)
        if mlp is None:
            mlp = Qwen2_5VisionMLP(a) if a.windowed else Qwen2VisionMLP(a)
        self.mlp = mlp

    def forward(self, x, cos, sin, plan: SegmentPlan) -> torch.Tensor:
        """(patches, hidden) -> the same: pre-norm attention within ``plan``'s segments,
        then the MLP, each added to the residual stream."""
        x = x + self.attn(self.norm1(x), cos, sin, plan)
        return x + self.mlp(self.norm2(x))


class QwenPatchMerger(nn.Module):
    """Each merge block's patches normed (``ln_q``), concatenated and projected by a
    two-layer GELU MLP into the language model's width."""

    def __init__(self, a: QwenVisionArch) -> None:
        super().__init__()
        self.ln_q = make_norm(a, a.hidden_size)
        width = a.hidden_size * a.merge_unit
        self.mlp = nn.Sequential(
            nn.Linear(width, width), nn.GELU(), nn.Linear(width, a.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(patches, hidden) -> (patches / merge ** 2, out_hidden_size)."""
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class QwenVisionTransformer(nn.Module):
    """The tower of Qwen2-VL or Qwen2.5-VL (module docstring); submodules named as HF's."""

    def __init__(self, arch: QwenVisionArch) -> None:
        super().__init__()
        self.arch = arch
        self.patch_embed = QwenVisionPatchEmbed(arch)
        self.blocks = nn.ModuleList(QwenVisionBlock(arch) for _ in range(arch.depth))
        self.merger = QwenPatchMerger(arch)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(patches, patch_dim) pixel values (any float dtype, any device) of images whose
        (t, h, w) patch grids are ``grid_thw`` (images, 3), their patches concatenated in
        order -> (patches / merge ** 2, out_hidden_size) in the weights' dtype, on their
        device: each image's merged rows, in order. ``ValueError`` for pixel values that
        do not match the grids."""
        a = self.arch
        grids = checked_grids(pixel_values, grid_thw, a)
        weight = self.patch_embed.proj.weight
        device = weight.device
        x = self.patch_embed(pixel_values.to(device, weight.dtype))  # (patches, hidden)
        cos, sin = rotary_cos_sin(patch_rows_cols(grids, a.spatial_merge_size), a, device)
        full = segment_plan(frame_bounds(grids), device)
        if a.windowed:
            order, bounds = window_order(grids, a.spatial_merge_size, a.window_units)
            order = order.to(device)
            windows = segment_plan(bounds, device)
            x, cos, sin = (t.view(-1, a.merge_unit, t.shape[-1])[order].flatten(0, 1)
                           for t in (x, cos, sin))  # fmt: skip
        for i, block in enumerate(self.blocks):
            window = a.windowed and i not in a.fullatt_block_indexes
            x = block(x, cos, sin, windows if window else full)
        out = self.merger(x)  # (patches / merge ** 2, out_hidden_size)
        if a.windowed:  # back to the images' row-major merge blocks
            out = out[torch.argsort(order)]
        return out

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        load_tower_weights(self, sd)


def checked_grids(
    pixel_values: torch.Tensor, grid_thw: torch.Tensor, a: QwenVisionArch
) -> list[tuple[int, int, int]]:
    """``grid_list`` of ``grid_thw``; ``ValueError`` for pixel values that do not match."""
    grids = grid_list(grid_thw, a.spatial_merge_size)
    patches = sum(t * h * w for t, h, w in grids)
    if pixel_values.shape != (patches, a.patch_dim):
        raise ValueError(
            f"pixel_values of shape {tuple(pixel_values.shape)}: the grids {grids} "
            f"need ({patches}, {a.patch_dim})"
        )
    return grids


def load_tower_weights(tower: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Fill every parameter of ``tower`` from HF tower tensors named without the model's
    ``visual.`` prefix (copied in, cast to the weights' dtype, shapes checked); other tensors
    are ignored. ``ValueError`` naming the tensors missing."""
    names = tower.state_dict().keys()
    missing = sorted(names - sd.keys())
    if missing:
        raise ValueError(f"the checkpoint lacks vision tower tensors {missing}")
    tower.load_state_dict({k: sd[k] for k in names})


def vision_tower(arch: QwenVisionArch) -> nn.Module:
    """The tower of ``arch`` (``vision_arch``'s), on the current default device."""
    if arch.model_type == QWEN3_VL:
        from vllm.model_executor.models.qwen3_vl_vision import Qwen3VisionTransformer

        return Qwen3VisionTransformer(arch)
    return QwenVisionTransformer(arch)
