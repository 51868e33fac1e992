"""The vision transformer of Qwen3-VL and Qwen3-VL-MoE (transformers' ``Qwen3VLVisionModel``
and ``Qwen3VLMoeVisionModel``: the same tower), built on Qwen2-VL's pieces
(``qwen2_vl_vision.py``: the patch grids, the 2D rotary, attention within each frame, the
block).

The image processor's patches come as Qwen2-VL's (``pixel_values`` in merge-block order,
``image_grid_thw``); the tower embeds each patch with a Conv3d that has a bias, adds a
learned position embedding (a square table of ``num_position_embeddings`` entries,
bilinearly resampled to the image's patch grid, corners on corners), runs LayerNorm
blocks (attention rotated by the patch's (row, column) as Qwen2-VL's, a two-layer MLP of
``hidden_act``), and the merger (LayerNorm of each patch, then each merge block's patches
concatenated and projected by a GELU MLP) makes the image's rows of the language model's
width. DeepStack: after each block of ``deepstack_visual_indexes``, a merger of its own
(its norm over the concatenated block, "postshuffle") makes one more set of rows of that
width, which the language model adds to its hidden state at the image's tokens after its
layer k (k-th feature in block order).

The tower returns each image's rows as one tensor ``[main | feature 0 | feature 1 ...]``
(concatenated on the last dimension), so that the runner carries them as any image's
rows; ``QwenVLForConditionalGeneration.merge_image_rows`` splits them.

Qwen3.5 and Qwen3.5-MoE (``qwen3_5_vision``, ``qwen3_5_moe_vision``: transformers'
``Qwen3_5VisionModel`` subclasses ``Qwen3VLVisionModel`` and deletes its deepstack mergers)
have this tower without DeepStack: the same tensors less ``deepstack_merger_list``, rows of
the language model's width alone.

Tensors are named as transformers names them (``patch_embed.``, ``pos_embed.``,
``blocks.N.``, ``merger.``, ``deepstack_merger_list.N.``), without ``visual.``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.clip import ACTIVATIONS
from vllm.model_executor.models.qwen2_vl_vision import (
    NORM_EPS,
    QWEN3_VL,
    QWEN3_VL_VISION_TYPES,
    QwenVisionArch,
    QwenVisionBlock,
    QwenVisionPatchEmbed,
    checked_grids,
    frame_bounds,
    load_tower_weights,
    patch_rows_cols,
    rotary_cos_sin,
    segment_plan,
)

# Qwen3.5's towers: Qwen3-VL's without DeepStack, whatever the config lists.
QWEN3_5_VISION_TYPES = ("qwen3_5_vision", "qwen3_5_moe_vision")


@dataclass(frozen=True)
class Qwen3VisionArch(QwenVisionArch):
    num_position_embeddings: int = 0  # the learned table: a square of this many entries
    # The blocks after which a deepstack merger runs, in the checkpoint's merger order.
    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, config: Any) -> Qwen3VisionArch:
        """The arch of an HF ``Qwen3VLVisionConfig`` or ``Qwen3VLMoeVisionConfig`` (the same
        tower), or of Qwen3.5's (``QWEN3_5_VISION_TYPES``: no deepstack mergers)."""
        kinds = (*QWEN3_VL_VISION_TYPES, *QWEN3_5_VISION_TYPES)
        if config.model_type not in kinds:
            raise ValueError(
                f"vision_config model_type {config.model_type!r} is not one of {', '.join(kinds)}"
            )
        deepstack = () if config.model_type in QWEN3_5_VISION_TYPES else (
            tuple(config.deepstack_visual_indexes)
        )  # fmt: skip
        arch = cls(
            model_type=QWEN3_VL,
            hidden_size=config.hidden_size,
            out_hidden_size=config.out_hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=config.num_heads,
            depth=config.depth,
            hidden_act=config.hidden_act,
            in_channels=config.in_channels,
            patch_size=config.patch_size,
            temporal_patch_size=config.temporal_patch_size,
            spatial_merge_size=config.spatial_merge_size,
            rope_theta=cls.check_patch_and_rope(config),
            num_position_embeddings=config.num_position_embeddings,
            deepstack_visual_indexes=deepstack,
        )
        arch.validate()
        return arch

    def validate(self) -> None:
        super().validate()
        if self.table_side**2 != self.num_position_embeddings:
            raise ValueError(
                f"vision_config.num_position_embeddings {self.num_position_embeddings}: a "
                "square number (the table is a square grid)"
            )
        ds = self.deepstack_visual_indexes
        if len(set(ds)) != len(ds) or any(not 0 <= i < self.depth for i in ds):
            raise ValueError(
                f"vision_config.deepstack_visual_indexes {list(ds)}: distinct blocks of "
                f"0..{self.depth - 1}"
            )

    @property
    def patch_bias(self) -> bool:
        return True

    @property
    def table_side(self) -> int:
        """The learned position table's side."""
        return math.isqrt(self.num_position_embeddings)


def bilinear_taps(
    rows_cols: torch.Tensor, sizes: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each patch at (row, column) ``rows_cols`` (patches, 2) of an image of ``sizes``
    (patches, 2) (h, w) patches: the four entries of a ``side`` x ``side`` table (row-major
    indices) around its place on the table, the image's corners on the table's
    (``align_corners``), and their bilinear weights (fp32): both (patches, 4)."""
    src = rows_cols.float() * (side - 1) / (sizes - 1).clamp(min=1)  # on the table, fp32
    lo = src.floor()
    frac = src - lo
    lo = lo.long()
    hi = (lo + 1).clamp(max=side - 1)  # the last row (column) has weight 0 past the edge
    (r0, c0), (r1, c1), (fr, fc) = lo.unbind(-1), hi.unbind(-1), frac.unbind(-1)
    index = torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], -1)
    weight = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], -1)
    return index, weight


class Qwen3VisionMLP(nn.Module):
    def __init__(self, a: Qwen3VisionArch) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.act = ACTIVATIONS[a.hidden_act]
        self.linear_fc2 = nn.Linear(a.intermediate_size, a.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Each merge block's patches concatenated and projected by a two-layer GELU MLP into
    the language model's width; normed per patch first (the main merger) or over the
    concatenated block (``postshuffle``: the deepstack mergers)."""

    def __init__(self, a: Qwen3VisionArch, postshuffle: bool) -> None:
        super().__init__()
        self.width = a.hidden_size * a.merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else a.hidden_size, eps=NORM_EPS)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, a.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(patches, hidden) -> (patches / merge ** 2, out_hidden_size)."""
        if self.postshuffle:
            x = self.norm(x.view(-1, self.width))
        else:
            x = self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    """Qwen3-VL's tower (module docstring); submodules named as HF's."""

    def __init__(self, arch: Qwen3VisionArch) -> None:
        super().__init__()
        self.arch = arch
        self.patch_embed = QwenVisionPatchEmbed(arch)
        self.pos_embed = nn.Embedding(arch.num_position_embeddings, arch.hidden_size)
        self.blocks = nn.ModuleList(
            QwenVisionBlock(arch, Qwen3VisionMLP(arch)) for _ in range(arch.depth)
        )
        self.merger = Qwen3PatchMerger(arch, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(arch, postshuffle=True) for _ in arch.deepstack_visual_indexes
        )

    @property
    def num_deepstack(self) -> int:
        return len(self.arch.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(patches, patch_dim) pixel values (any float dtype, any device) of images whose
        (t, h, w) patch grids are ``grid_thw`` (images, 3), their patches concatenated in
        order -> (patches / merge ** 2, out_hidden_size * (1 + num_deepstack)) in the
        weights' dtype, on their device: each image's merged rows in order, each row the
        main embedding, then the deepstack features in block order. ``ValueError`` for
        pixel values that do not match the grids."""
        a = self.arch
        grids = checked_grids(pixel_values, grid_thw, a)
        weight = self.patch_embed.proj.weight
        device = weight.device
        x = self.patch_embed(pixel_values.to(device, weight.dtype))  # (patches, hidden)
        rows_cols = patch_rows_cols(grids, a.spatial_merge_size)
        x = x + self.position_embeddings(rows_cols, grids).to(x.dtype)
        cos, sin = rotary_cos_sin(rows_cols, a, device)
        plan = segment_plan(frame_bounds(grids), device)
        features = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, plan)
            if i in a.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[a.deepstack_visual_indexes.index(i)]
                features.append(merger(x))
        return torch.cat([self.merger(x), *features], dim=-1)

    def position_embeddings(
        self, rows_cols: torch.Tensor, grids: list[tuple[int, int, int]]
    ) -> torch.Tensor:
        """fp32 (patches, hidden): each patch's learned position, the table resampled to
        its image's grid (``bilinear_taps``)."""
        sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grids])
        index, weight = bilinear_taps(rows_cols, sizes, self.arch.table_side)
        table = self.pos_embed.weight
        taps = table[index.to(table.device)].float()  # (patches, 4, hidden)
        return (taps * weight.to(table.device)[..., None]).sum(1)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        load_tower_weights(self, sd)
