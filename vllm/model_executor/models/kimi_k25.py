"""Kimi K2.5 (``KimiK25ForConditionalGeneration``, transformers' ``kimi_k25``): Kimi-K2's
language model (DeepSeek-V3's: ``deepseek_v2.py``, latent attention cached as one latent
row, ``noaux_tc`` experts; transformers reads a ``kimi_k2`` ``text_config`` as
``deepseek_v3``) behind a MoonViT-style vision tower and a projector.

**The tower** (``KimiVisionTower``), on each image's (h, w) grid of ``patch_size`` patches
(row-major; images only, one frame: t = 1):

- patch embedding: a ``patch_size`` convolution (a linear map of the flattened patch);
- plus the learned ``pos_emb_height`` x ``pos_emb_width`` position table resampled to
  (h, w) bicubically (``F.interpolate``, ``align_corners`` False; a table of the grid's
  own size is read as it is); a single frame takes no temporal term;
- ``num_hidden_layers`` pre-LayerNorm layers (eps 1e-5): attention over the image's own
  patches (q, k, v and output with biases), the queries and keys rotated by a 2D axial
  rotary (``head_dim / 4`` frequencies ``theta ** (-4i / head_dim)``; frequency i turns
  dims (2i, 2i + 1) by the column's angle and the row's, those dims and their ``head_dim /
  2`` shift paired as Neox halves); then an MLP (``fc1``, ``hidden_act``, ``fc2``);
- a final LayerNorm, then each ``merge_kernel_size`` block of patches gathered into one
  row (the block's patches row-major, each its ``hidden_size`` features).

**The projector** (``mm_projector``): a LayerNorm over each patch's features
(``projection_layer_norm_eps``), the block's patches concatenated, ``in_proj``, exact GELU,
``out_proj`` to the text hidden size: one row per block, blocks row-major, the rows an
image's ``<|media_pad|>`` tokens (``image_token_id``) take.

**Prompts**: the "grid" layout of ``vllm.multimodal.processing`` (Qwen2-VL's): the image
processor sizes an image to a grid of patches (``KimiK25ImageProcessor``: transformers'
sizing, no more than ``max_patches`` patches nor ``size["max_height"]`` patches a side,
never enlarged, padded at the bottom and right to multiples of ``patch_size *
merge_size``; resized with PIL's bicubic, transformers' own needs torchvision) and its one
placeholder becomes h * w / merge**2 image tokens. No M-RoPE: the language model's
positions are the tokens' indices.

**Tensors**: transformers 5's names (``model.language_model.``, ``lm_head``,
``model.vision_tower.``, ``model.mm_projector.``) and the Hub's original ones
(``language_model.model.``, ``language_model.lm_head``, ``vision_tower.encoder.blocks.N``
with a fused ``wqkv`` whose q and k rows pair interleaved dims, ``norm0/1``, ``mlp.fc0/1``,
``wo``, ``vision_tower.patch_embed.pos_emb.weight``, ``mm_projector.proj.0/2``), renamed
as transformers' conversion does, and the mix of both that transformers' save_pretrained
writes (the language model's layers as ``blocks``). A checkpoint without vision tensors is
served as its language model alone.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models.clip import activation, rotate
from vllm.model_executor.models.deepseek_v2 import DeepseekV2Arch, DeepseekV3ForCausalLM
from vllm.model_executor.models.mistral3 import text_fields
from vllm.model_executor.models.utils import (
    config_from_dict,
    language_model_tensors,
    takes_images,
)

logger = logging.getLogger(__name__)

# transformers' LayerNorm eps of the tower's layers and its final norm.
VISION_NORM_EPS = 1e-5
# transformers' Kimi_K25ImageProcessor's defaults.
DEFAULT_PROCESSOR = dict(
    size={"max_height": 512, "max_width": 512}, max_patches=16384, patch_size=14,
    merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    rescale_factor=1 / 255, do_resize=True, do_rescale=True, do_normalize=True,
)  # fmt: skip


def _config(hf_config: Any) -> Any:
    return config_from_dict(hf_config, {"kimi_k25": "Kimi_K25Config"})


def _pair(value: Any) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


@dataclass(frozen=True)
class KimiVisionArch:
    patch_size: int
    hidden_size: int
    num_heads: int
    num_layers: int
    intermediate_size: int
    hidden_act: str
    pos_emb_height: int
    pos_emb_width: int
    merge: int  # the merge kernel's side (square: one image token per merge x merge patches)
    rope_theta: float
    projection_eps: float
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, config: Any) -> KimiVisionArch:
        """The vision side of a ``Kimi_K25Config``; ``ValueError`` naming the field for
        what the tower does not run."""
        v = config.vision_config
        kh, kw = _pair(v.merge_kernel_size)
        if kh != kw:
            raise ValueError(
                f"vision_config merge_kernel_size {v.merge_kernel_size!r}: a square kernel "
                "(an image's tokens are its grid's h * w / merge**2)"
            )
        if v.hidden_size % v.num_attention_heads or (v.hidden_size // v.num_attention_heads) % 4:
            raise ValueError(
                f"vision_config hidden_size {v.hidden_size} / num_attention_heads "
                f"{v.num_attention_heads}: a head_dim that is a multiple of 4 (2D rotary)"
            )
        rope = dict(v.rope_parameters or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"vision_config rope_parameters rope_type {rope['rope_type']!r}: only 'axial'"
            )
        if config.projection_hidden_size != v.hidden_size:
            raise ValueError(
                f"projection_hidden_size {config.projection_hidden_size}: the projector's "
                f"norm is over each patch's features (vision hidden_size {v.hidden_size})"
            )
        activation(v.hidden_act, "vision_config hidden_act")
        return cls(
            patch_size=v.patch_size,
            hidden_size=v.hidden_size,
            num_heads=v.num_attention_heads,
            num_layers=v.num_hidden_layers,
            intermediate_size=v.intermediate_size,
            hidden_act=v.hidden_act,
            pos_emb_height=v.pos_emb_height,
            pos_emb_width=v.pos_emb_width,
            merge=kh,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            projection_eps=float(config.projection_layer_norm_eps),
            text_hidden_size=config.get_text_config().hidden_size,
        )


@dataclass(frozen=True)
class KimiK25Arch(DeepseekV2Arch):
    """The language model's arch (DeepSeek-V3's) and the vision side's."""

    vision: KimiVisionArch | None = None  # None: a config without a vision_config
    image_token_id: int = 163605

    @classmethod
    def from_hf(cls, hf_config: Any) -> KimiK25Arch:
        config = _config(hf_config)
        text = config.get_text_config()
        if text.model_type not in ("deepseek_v3", "kimi_k2"):
            raise ValueError(
                f"text_config model_type {text.model_type!r}: Kimi K2.5 runs Kimi-K2's "
                "(DeepSeek-V3's) language model"
            )
        base = DeepseekV2Arch.from_hf(text)
        vision = KimiVisionArch.from_hf(config) if takes_images(hf_config) else None
        return cls(**text_fields(config, base), vision=vision, image_token_id=config.image_token_id)


def qwen_vl_image_layout(hf_config: Any) -> tuple[int, int]:
    """(image token id, merge side): the "grid" prompt layout's (``processing.py``)."""
    config = _config(hf_config)
    return config.image_token_id, _pair(config.vision_config.merge_kernel_size)[0]


# -- the vision tower ---------------------------------------------------------------------


def grid_positions(h: int, w: int, device) -> torch.Tensor:
    """(h * w, 2) (row, column) of a grid's patches, row-major."""
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    return torch.stack((rows, cols), dim=-1)


def axial_rotary(a: KimiVisionArch, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), (n, head_dim) fp32, of the patches at ``positions`` (n, 2): frequency i
    at dims 2i (the column's angle) and 2i + 1 (the row's), repeated over the second half."""
    quarter = a.head_dim // 4
    inv_freq = a.rope_theta ** (
        -torch.arange(0, 2 * quarter, 2, dtype=torch.float32, device=positions.device)
        / (2 * quarter)
    )
    angles = positions.float()[:, :, None] * inv_freq  # (n, [row, col], quarter)
    angles = angles.flip(1).transpose(1, 2).reshape(len(positions), 2 * quarter)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class KimiPositionEmbedding(nn.Module):
    def __init__(self, a: KimiVisionArch) -> None:
        super().__init__()
        self.position_embeddings = nn.Parameter(
            torch.empty(a.pos_emb_height, a.pos_emb_width, a.hidden_size)
        )

    def forward(self, h: int, w: int) -> torch.Tensor:
        """(h * w, hidden): the table resampled to an h x w grid, row-major."""
        table = self.position_embeddings
        if tuple(table.shape[:2]) == (h, w):
            return table.reshape(h * w, -1)
        grid = table.permute(2, 0, 1)[None].float()
        out = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        return out[0].permute(1, 2, 0).reshape(h * w, -1).to(table.dtype)


class KimiPatchEmbed(nn.Module):
    def __init__(self, a: KimiVisionArch) -> None:
        super().__init__()
        p = a.patch_size
        self.proj = nn.Conv2d(3, a.hidden_size, kernel_size=p, stride=p)
        self.pos_emb = KimiPositionEmbedding(a)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """(n, 3 * p * p) patches -> (n, hidden): the convolution over each patch."""
        return F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)


class KimiVisionAttention(nn.Module):
    def __init__(self, a: KimiVisionArch) -> None:
        super().__init__()
        self.a = a
        d = a.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d) for _ in range(3))
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, rotary, lengths: list[int]) -> torch.Tensor:
        a = self.a
        n = x.shape[0]
        shape = (n, a.num_heads, a.head_dim)
        cos, sin = rotary
        q = rotate(self.q_proj(x).view(shape), cos, sin)
        k = rotate(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            o = F.scaled_dot_product_attention(
                qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)
            )  # each image attends to itself alone
            outs.append(o.transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, a.hidden_size))


class KimiVisionMLP(nn.Module):
    def __init__(self, a: KimiVisionArch) -> None:
        super().__init__()
        self.fc1 = nn.Linear(a.hidden_size, a.intermediate_size)
        self.fc2 = nn.Linear(a.intermediate_size, a.hidden_size)
        self.act = activation(a.hidden_act, "vision_config hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class KimiVisionLayer(nn.Module):
    def __init__(self, a: KimiVisionArch) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(a.hidden_size, eps=VISION_NORM_EPS)
        self.norm2 = nn.LayerNorm(a.hidden_size, eps=VISION_NORM_EPS)
        self.attn = KimiVisionAttention(a)
        self.mlp = KimiVisionMLP(a)

    def forward(self, x: torch.Tensor, rotary, lengths: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, lengths)
        return x + self.mlp(self.norm2(x))


class KimiVisionTower(nn.Module):
    """Patches of images -> their merged blocks (module docstring)."""

    def __init__(self, a: KimiVisionArch) -> None:
        super().__init__()
        self.a = a
        self.patch_embed = KimiPatchEmbed(a)
        self.layers = nn.ModuleList(KimiVisionLayer(a) for _ in range(a.num_layers))
        self.final_layernorm = nn.LayerNorm(a.hidden_size, eps=VISION_NORM_EPS)

    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """(patches, 3 * p * p) of images of (h, w) ``grids``, concatenated -> (blocks,
        merge**2, hidden): each image's merge x merge blocks, row-major."""
        a, m = self.a, self.a.merge
        lengths = [h * w for h, w in grids]
        x = self.patch_embed(patches)
        pos = torch.cat([self.patch_embed.pos_emb(h, w) for h, w in grids])
        x = x + pos.to(x.dtype)
        positions = torch.cat([grid_positions(h, w, x.device) for h, w in grids])
        rotary = axial_rotary(a, positions)
        for layer in self.layers:
            x = layer(x, rotary, lengths)
        x = self.final_layernorm(x)
        blocks = []
        for part, (h, w) in zip(x.split(lengths), grids, strict=True):
            b = part.view(h // m, m, w // m, m, a.hidden_size).transpose(1, 2)
            blocks.append(b.reshape(h // m * (w // m), m * m, a.hidden_size))
        return torch.cat(blocks)


class KimiProjector(nn.Module):
    def __init__(self, a: KimiVisionArch) -> None:
        super().__init__()
        width = a.hidden_size * a.merge**2
        self.pre_norm = nn.LayerNorm(a.hidden_size, eps=a.projection_eps)
        self.in_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, a.text_hidden_size)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """(blocks, merge**2, vision hidden) -> (blocks, text hidden)."""
        x = self.pre_norm(blocks).flatten(1)
        return self.out_proj(F.gelu(self.in_proj(x)))


def vision_tensors(
    sd: dict[str, torch.Tensor], num_heads: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tower's and the projector's tensors of either layout (module docstring; a
    ``model.`` prefix or none, the names transformers' save_pretrained writes mixed
    among them), named as ``KimiVisionTower`` and ``KimiProjector`` name them."""
    tower: dict[str, torch.Tensor] = {}
    projector: dict[str, torch.Tensor] = {}
    renames = {"norm0": "norm1", "norm1": "norm2", "mlp.fc0": "mlp.fc1",
               "mlp.fc1": "mlp.fc2", "wo": "attn.proj"}  # fmt: skip
    for key, tensor in sd.items():
        key = key.removeprefix("model.")
        if key.startswith("mm_projector."):
            name = key.removeprefix("mm_projector.")
            name = name.replace("proj.0.", "in_proj.").replace("proj.2.", "out_proj.")
            projector[name] = tensor
            continue
        if not key.startswith("vision_tower."):
            continue
        name = key.removeprefix("vision_tower.").removeprefix("encoder.")
        if name == "patch_embed.pos_emb.weight":
            tower["patch_embed.pos_emb.position_embeddings"] = tensor
        elif name.startswith("blocks."):  # the Hub's original layer
            index, _, rest = name.removeprefix("blocks.").partition(".")
            module, _, leaf = rest.rpartition(".")
            prefix = f"layers.{index}."
            if module == "wqkv":
                q, k, v = tensor.chunk(3, dim=0)
                tower[f"{prefix}attn.q_proj.{leaf}"] = interleaved_to_halves(q, num_heads)
                tower[f"{prefix}attn.k_proj.{leaf}"] = interleaved_to_halves(k, num_heads)
                tower[f"{prefix}attn.v_proj.{leaf}"] = v
            else:
                tower[f"{prefix}{renames.get(module, module)}.{leaf}"] = tensor
        else:
            tower[name] = tensor
    return tower, projector


def interleaved_to_halves(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows of q or k (a weight or a bias) whose rotated pairs are adjacent, each head's
    reordered evens then odds: the pairs become Neox halves."""
    rows = t.shape[0]
    half = rows // num_heads // 2
    x = t.reshape(num_heads, half, 2, *t.shape[1:]).transpose(1, 2)
    return x.reshape(rows, *t.shape[1:])


class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    """Kimi K2.5: DeepSeek-V3's language model with the MoonViT-style tower and projector
    (module docstring)."""

    # Decided per checkpoint (``takes_images``); an instance whose checkpoint holds no
    # tower sets its own False when loading.
    supports_images: ClassVar[bool] = True
    image_layout: ClassVar[str] = "grid"  # vllm.multimodal.processing
    uses_mrope: ClassVar[bool] = False

    @classmethod
    def takes_images(cls, hf_config: Any) -> bool:
        return takes_images(hf_config)

    @staticmethod
    def arch_from_hf(hf_config: Any) -> KimiK25Arch:
        return KimiK25Arch.from_hf(hf_config)

    def __init__(self, arch: KimiK25Arch) -> None:
        super().__init__(arch)
        self.vision_tower: KimiVisionTower | None = None
        self.mm_projector: KimiProjector | None = None
        if arch.vision is not None:
            self.vision_tower = KimiVisionTower(arch.vision)
            self.mm_projector = KimiProjector(arch.vision)
        else:
            self.supports_images = False

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor, grid_thw: Any) -> torch.Tensor:
        """Patches of images, (patches, 3, p, p) or (patches, 3 * p * p), concatenated
        (any float dtype, any device), and their (t, h, w) grids (t = 1, h and w multiples
        of the merge side) -> (sum of h * w / merge**2, text hidden) rows in the model's
        dtype, each image's in order."""
        if self.vision_tower is None:
            raise ValueError("this Kimi K2.5 checkpoint holds no vision tower: text only")
        a = self.arch.vision
        grids = [tuple(int(v) for v in g) for g in torch.as_tensor(grid_thw).tolist()]
        for t, h, w in grids:
            if t != 1 or h % a.merge or w % a.merge:
                raise ValueError(
                    f"grid_thw {(t, h, w)}: one frame (images), sides multiples of the "
                    f"merge side {a.merge}"
                )
        patches = pixel_values.reshape(pixel_values.shape[0], -1)
        if patches.shape != (sum(h * w for _, h, w in grids), 3 * a.patch_size**2):
            raise ValueError(
                f"pixel_values {tuple(pixel_values.shape)}: one (3, {a.patch_size}, "
                f"{a.patch_size}) patch per cell of the grids {grids}"
            )
        weight = self.mm_projector.in_proj.weight
        patches = patches.to(device=weight.device, dtype=weight.dtype)
        blocks = self.vision_tower(patches, [(h, w) for _, h, w in grids])
        return self.mm_projector(blocks)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The language model's tensors, the tower's and the projector's, from either
        layout (module docstring); without any vision tensor, the language model alone."""
        # transformers' save_pretrained writes the language model's layers as "blocks".
        blocks = "language_model.model.blocks."
        text = {
            (
                f"language_model.model.layers.{k.removeprefix(blocks)}"
                if k.startswith(blocks)
                else k
            ): v
            for k, v in sd.items()
        }
        super().load_weights(language_model_tensors(text))
        if self.vision_tower is None:
            return
        tower, projector = vision_tensors(sd, self.arch.vision.num_heads)
        if not tower:
            logger.warning("no vision tower tensors in the checkpoint: served as text only")
            self.vision_tower = self.mm_projector = None
            self.supports_images = False
            return
        with torch.no_grad():
            self.vision_tower.load_state_dict(tower)
            self.mm_projector.load_state_dict(projector)


# -- the image processor ------------------------------------------------------------------


class _ProcessorKwargs:
    """The arguments a request or the server may give (``processing.py`` reads these
    annotations); patch and merge sizes are fixed by the model."""

    size: dict
    max_patches: int
    patch_size: int
    merge_size: int


def navit_size(
    height: int, width: int, patch: int, merge: int, max_patches: int, max_side: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized height, width), (padded height, width)) of an image, as transformers'
    Kimi K2.5 processor sizes it: scaled down (never up) to at most ``max_patches``
    patches and ``max_side`` patches a side, then padded to multiples of ``patch *
    merge``."""
    patches_h, patches_w = max(1, height // patch), max(1, width // patch)
    scale = min(
        1.0,
        math.sqrt(max_patches / (patches_h * patches_w)),
        max_side * patch / height,
        max_side * patch / width,
    )
    new_h = min(max(1, int(height * scale)), max_side * patch)
    new_w = min(max(1, int(width * scale)), max_side * patch)
    f = patch * merge
    return (new_h, new_w), (-(-new_h // f) * f, -(-new_w // f) * f)


class KimiK25ImageProcessor:
    """Images -> ``pixel_values`` (patches, 3, p, p) and ``image_grid_thw`` (images, 3):
    transformers' ``Kimi_K25ImageProcessor`` (module docstring), over PIL."""

    valid_kwargs = _ProcessorKwargs

    def __init__(self, **settings: Any) -> None:
        merged = {**DEFAULT_PROCESSOR, **settings}
        for key, value in merged.items():
            setattr(self, key, value)

    @classmethod
    def from_folder(cls, path: str | Path) -> KimiK25ImageProcessor:
        """Its settings from the folder's preprocessor_config.json (those it holds)."""
        file = Path(path) / "preprocessor_config.json"
        saved = json.loads(file.read_text()) if file.is_file() else {}
        return cls(**{k: v for k, v in saved.items() if k in DEFAULT_PROCESSOR})

    def __call__(self, images: list[Any], return_tensors: str = "pt", **kwargs: Any):
        s = {**self.__dict__, **kwargs}
        size = s["size"]
        max_side = size.get("max_height") if isinstance(size, dict) else size.max_height
        patch, merge = s["patch_size"], s["merge_size"]
        mean = torch.tensor(s["image_mean"], dtype=torch.float32)[:, None, None]
        std = torch.tensor(s["image_std"], dtype=torch.float32)[:, None, None]
        all_patches, grids = [], []
        for image in images:
            image = image.convert("RGB")
            width, height = image.size
            (new_h, new_w), (pad_h, pad_w) = navit_size(
                height, width, patch, merge, s["max_patches"], max_side
            )
            if s["do_resize"] and (new_h, new_w) != (height, width):
                from PIL import Image

                image = image.resize((new_w, new_h), Image.Resampling.BICUBIC)
            else:
                new_h, new_w = height, width
            x = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1)
            if s["do_rescale"]:
                x = x * s["rescale_factor"]
            x = F.pad(x, (0, pad_w - new_w, 0, pad_h - new_h))  # zeros, before normalising
            if s["do_normalize"]:
                x = (x - mean) / std
            gh, gw = pad_h // patch, pad_w // patch
            x = x.reshape(3, gh, patch, gw, patch).permute(1, 3, 0, 2, 4)
            all_patches.append(x.reshape(gh * gw, 3, patch, patch))
            grids.append([1, gh, gw])
        return {"pixel_values": torch.cat(all_patches), "image_grid_thw": torch.tensor(grids)}


def make_image_processor(path: str | Path) -> KimiK25ImageProcessor:
    """The front end's image processor of a model folder (``processing.py``)."""
    return KimiK25ImageProcessor.from_folder(path)
