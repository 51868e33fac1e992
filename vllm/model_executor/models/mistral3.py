"""Mistral 3's multimodal checkpoints (``Mistral3ForConditionalGeneration``:
Mistral-Small-3.1/3.2, Magistral-Small, Mistral-Small-4): a Pixtral vision encoder
(``pixtral_vision.py``), a projector with a patch merger, and the language model of
``text_config``: Mistral's (Llama's) or Mistral 4's latent attention and experts.

Each image keeps its own size: the image processor resizes it (its long side at most
``size["longest_edge"]``) to multiples of ``patch_size * spatial_merge_size`` pixels, and
the encoder takes it unpadded. Its rows of embeddings (``embed_images``): the encoder's
hidden state ``vision_feature_layer``, RMS-normed (``norm``, the text model's eps), each
``spatial_merge_size`` x ``spatial_merge_size`` block of patches merged into one row (its
patches' features concatenated feature-major, as ``torch.nn.functional.unfold`` orders
them: feature f of the patch at (i, j) in the block at ``(f * m + i) * m + j``) and
projected (``merging_layer``, no bias), then ``linear_1``, ``projector_hidden_act``,
``linear_2`` (their biases by ``multimodal_projector_bias``): one row per merged patch,
row-major. The prompt holds, per row of merged patches, as many ``[IMG]`` tokens then an
``[IMG_BREAK]``, the last row's break an ``[IMG_END]`` (``image_rows_layout``; the front
end's "rows" layout); only the ``[IMG]`` tokens take the image's rows. The language model
is ``LlamaForCausalLM`` itself, or for a ``mistral4`` ``text_config`` (Mistral Small 4)
``Mistral4ForCausalLM`` (``deepseek_v2.py``): a class per language model
(``Mistral3ForConditionalGeneration``, ``Mistral3MLAForConditionalGeneration``, the
registry choosing by the text config's ``model_type``), the vision side theirs alike
(``PixtralImages``).

Tensors: the Hub's layout (``vision_tower.``, ``multi_modal_projector.``,
``language_model.model.``, ``language_model.lm_head``) and the one transformers 5 holds in
memory and saves (``model.vision_tower.``, ``model.multi_modal_projector.``,
``model.language_model.``, ``lm_head``). A checkpoint without any vision tower tensors (a
config.json without a ``vision_config``) is served as its language model alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.clip import activation
from vllm.model_executor.models.deepseek_v2 import DeepseekV2Arch, Mistral4ForCausalLM
from vllm.model_executor.models.llama import LlamaArch, LlamaForCausalLM, RMSNorm
from vllm.model_executor.models.pixtral_vision import PixtralVisionArch, PixtralVisionModel
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.utils import (
    config_from_dict,
    language_model_tensors,
    takes_images,
)

logger = logging.getLogger(__name__)

# transformers' PixtralProcessor's defaults: the tokens that end a row and the image.
IMAGE_BREAK_TOKEN, IMAGE_END_TOKEN = "[IMG_BREAK]", "[IMG_END]"
PREFIXES = {"vision_tower.": "vision", "multi_modal_projector.": "projector"}


def _config(hf_config: Any) -> Any:
    return config_from_dict(hf_config, {"mistral3": "Mistral3Config"})


@dataclass(frozen=True)
class ImageRowsLayout:
    """How an image's placeholder expands in the prompt (the front end's "rows" layout):
    an image resized to R x C squares of ``patch_pixels`` becomes, per row, C
    ``image_token_id`` then the break token, the last one the end token. A break or end
    token's id is None where the config does not give it: the tokenizer's ``*_token``."""

    image_token_id: int
    patch_pixels: int  # patch_size * spatial_merge_size: one image token per square
    break_token: str = IMAGE_BREAK_TOKEN
    end_token: str = IMAGE_END_TOKEN
    break_token_id: int | None = None
    end_token_id: int | None = None


def image_rows_layout(hf_config: Any) -> ImageRowsLayout:
    """The image layout of a Mistral 3 config (transformers' or the dict of its
    config.json): ``image_token_index`` (alias ``image_token_id``), the merged patch's
    side, and the break and end token ids where the config names them
    (``image_break_token_id``, ``image_end_token_id``)."""
    config = _config(hf_config)
    vision = config.vision_config
    return ImageRowsLayout(
        image_token_id=config.image_token_index,
        patch_pixels=vision.patch_size * config.spatial_merge_size,
        break_token_id=getattr(config, "image_break_token_id", None),
        end_token_id=getattr(config, "image_end_token_id", None),
    )


def pixtral_side(config: Any) -> dict[str, Any]:
    """The vision side's arch fields of a Mistral 3 config (both arches'), the tower built
    to the feature layer read."""
    vision = config.vision_config
    layer = config.vision_feature_layer
    n = vision.num_hidden_layers
    if not isinstance(layer, int) or not -(n + 1) <= layer <= n:
        raise ValueError(
            f"vision_feature_layer {layer!r}: one index of the tower's {n + 1} hidden "
            f"states (-{n + 1} to {n}; the projector's norm and merger take one)"
        )
    activation(config.projector_hidden_act, "projector_hidden_act")
    return dict(
        vision=PixtralVisionArch.from_hf(vision, layer if layer >= 0 else n + 1 + layer),
        spatial_merge_size=config.spatial_merge_size,
        projector_hidden_act=config.projector_hidden_act,
        projector_bias=bool(config.multimodal_projector_bias),
    )


def text_fields(config: Any, base: Any) -> dict[str, Any]:
    """The language model's arch ``base`` as fields, the head tied as transformers ties it:
    by the top-level flag, unless the checkpoint holds its own: tied only where both say so
    (an untied head missing from the checkpoint is loaded from the embeddings,
    ``load_embeddings_and_head``)."""
    out = {f.name: getattr(base, f.name) for f in fields(base)}
    out["tie_word_embeddings"] &= bool(getattr(config, "tie_word_embeddings", True))
    return out


@dataclass(frozen=True)
class Mistral3Arch(LlamaArch):
    """The language model's arch, and the vision side's."""

    # None only as a dataclass default (fields after LlamaArch's need one): from_hf sets it.
    vision: PixtralVisionArch | None = None  # built to the feature layer read
    spatial_merge_size: int = 2
    projector_hidden_act: str = "gelu"
    projector_bias: bool = False

    @classmethod
    def from_hf(cls, config: Any) -> Mistral3Arch:
        text = config.get_text_config()
        text_cls, text_arch = ModelRegistry.resolve_model_cls(text)
        if text_cls is not LlamaForCausalLM or text.model_type == "granite":
            raise ValueError(
                f"text_config {text_arch} ({text.model_type}): Mistral 3 runs the dense "
                "Llama-family language models (Mistral's), Granite excepted, and Mistral 4's "
                "(Mistral3MLAForConditionalGeneration)"
            )
        return cls(**text_fields(config, LlamaArch.from_hf(text)), **pixtral_side(config))


@dataclass(frozen=True)
class Mistral3MLAArch(DeepseekV2Arch):
    """Mistral 4's language model's arch (latent attention, experts), and the vision
    side's (``Mistral3Arch``'s fields)."""

    vision: PixtralVisionArch | None = None
    spatial_merge_size: int = 2
    projector_hidden_act: str = "gelu"
    projector_bias: bool = False

    @classmethod
    def from_hf(cls, config: Any) -> Mistral3MLAArch:
        text = config.get_text_config()
        if text.model_type != "mistral4":
            raise ValueError(
                f"text_config model_type {text.model_type!r}: this class runs Mistral 4's "
                "(mistral4) language model"
            )
        base = DeepseekV2Arch.from_hf(text)
        return cls(**text_fields(config, base), **pixtral_side(config))


def merge_patches(features: torch.Tensor, grid: tuple[int, int], m: int) -> torch.Tensor:
    """(h * w, d) row-major patches of an h x w grid -> (h / m * w / m, d * m * m): each
    m x m block of patches one row, row-major over the blocks, its features
    feature-major (``unfold``'s order: module docstring)."""
    h, w = grid
    if h % m or w % m:
        raise ValueError(f"a patch grid of {h} x {w}: the sides must be multiples of {m}")
    d = features.shape[-1]
    x = features.view(h // m, m, w // m, m, d)  # (block row, i, block col, j, d)
    x = x.permute(0, 2, 4, 1, 3)  # (block row, block col, d, i, j)
    return x.reshape(h // m * (w // m), d * m * m)


class Mistral3PatchMerger(nn.Module):
    def __init__(self, a: Mistral3Arch | Mistral3MLAArch) -> None:
        super().__init__()
        self.m = a.spatial_merge_size
        width = a.vision.hidden_size
        self.merging_layer = nn.Linear(width * self.m**2, width, bias=False)

    def forward(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """(patches, d) of images of ``grids``, concatenated -> their merged rows."""
        parts = features.split([h * w for h, w in grids])
        merged = [merge_patches(x, g, self.m) for x, g in zip(parts, grids, strict=True)]
        return self.merging_layer(torch.cat(merged))


class Mistral3MultiModalProjector(nn.Module):
    def __init__(self, a: Mistral3Arch | Mistral3MLAArch) -> None:
        super().__init__()
        width = a.vision.hidden_size
        self.norm = RMSNorm(width, a.rms_norm_eps)
        self.patch_merger = Mistral3PatchMerger(a)
        self.linear_1 = nn.Linear(width, a.hidden_size, bias=a.projector_bias)
        self.act = activation(a.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(a.hidden_size, a.hidden_size, bias=a.projector_bias)

    def forward(self, features: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """(patches, vision hidden) -> (merged patches, hidden)."""
        merged = self.patch_merger(self.norm(features), grids)
        return self.linear_2(self.act(self.linear_1(merged)))


class PixtralImages:
    """The vision side of a Mistral 3 model, in front of the language model class it is
    mixed into (which gives every other method, ``forward`` taking ``inputs_embeds``):
    ``vision_tower`` and ``multi_modal_projector`` beside it (module docstring)."""

    gguf_layout: ClassVar[Any] = None
    # Decided per checkpoint (``takes_images``); an instance whose checkpoint holds no
    # tower sets its own False when loading.
    supports_images: ClassVar[bool] = True
    # The prompt's layout of an image (vllm.multimodal.processing): rows of [IMG] tokens.
    image_layout: ClassVar[str] = "rows"
    # embed_images takes a list of images, each at its own size (the model runner's
    # _encode), and gives a list of their rows.
    images_at_own_size: ClassVar[bool] = True

    @classmethod
    def takes_images(cls, hf_config: Any) -> bool:
        return takes_images(hf_config)

    def __init__(self, arch: Any) -> None:
        super().__init__(arch)
        self.vision_tower: PixtralVisionModel | None = PixtralVisionModel(arch.vision)
        self.multi_modal_projector: nn.Module | None = Mistral3MultiModalProjector(arch)

    @torch.inference_mode()
    def embed_images(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Pixels of images, (channels, H, W) each or (n, channels, H, W) of n images of one
        size (any float dtype, any device; sides multiples of ``patch_size *
        spatial_merge_size``) -> each image's (H * W / (patch * merge) ** 2, hidden)
        embeddings in the model's dtype, on its device: its [IMG] tokens' rows, in order.
        The images are encoded together, each attending to itself alone."""
        if self.vision_tower is None:
            raise ValueError("this Mistral 3 checkpoint holds no vision tower: text only")
        images = [image for x in pixel_values for image in (x if x.dim() == 4 else [x])]
        features, grids = self.vision_tower(images)
        rows = self.multi_modal_projector(features, grids)
        m = self.arch.spatial_merge_size
        return list(rows.split([h // m * (w // m) for h, w in grids]))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The language model's tensors (its class's ``load_weights``), the tower's and
        the projector's, from either layout (module docstring); without any tower tensor
        the model is its language model alone."""
        super().load_weights(language_model_tensors(sd))
        parts: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "projector": {}}
        for key, tensor in sd.items():
            key = key.removeprefix("model.")
            for prefix, part in PREFIXES.items():
                if key.startswith(prefix):
                    parts[part][key.removeprefix(prefix)] = tensor
        if not parts["vision"]:
            logger.warning("no vision tower tensors in the checkpoint: served as text only")
            self.vision_tower = self.multi_modal_projector = None
            self.supports_images = False
            return
        with torch.no_grad():
            self.vision_tower.load_weights(parts["vision"])
            self.multi_modal_projector.load_state_dict(parts["projector"])


class Mistral3ForConditionalGeneration(PixtralImages, LlamaForCausalLM):
    """Mistral 3 over the Llama-family language model (Mistral Small 3.x, Magistral)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Mistral3Arch:
        return Mistral3Arch.from_hf(hf_config)


class Mistral3MLAForConditionalGeneration(PixtralImages, Mistral4ForCausalLM):
    """Mistral 3 over Mistral 4's language model (Mistral Small 4: a ``mistral4``
    ``text_config``): latent attention, experts, the query scale by position."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Mistral3MLAArch:
        return Mistral3MLAArch.from_hf(hf_config)
