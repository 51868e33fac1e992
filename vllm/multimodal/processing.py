"""Images -> what the engine carries (``MultiModalFeature``), in the front end.

Each image goes through the model's own image processor (transformers'
``AutoImageProcessor`` from the model folder: resize, crop, normalise) into pixel values.
The prompt names each image with one placeholder token (LLaVA's ``<image>``), in the
images' order; each placeholder becomes as many placeholder tokens as the model makes
embeddings of an image, as vLLM's prompt replacement does, so the prompt's length is what
the model computes and what the KV cache holds.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from typing import Any

import torch

from vllm.exceptions import VLLMValidationError
from vllm.multimodal.inputs import MultiModalFeature

logger = logging.getLogger(__name__)

# vLLM v1's limit per modality when --limit-mm-per-prompt names none.
DEFAULT_LIMIT_PER_PROMPT = 999
MODALITIES = ("image",)
PARAM = "multi_modal_data"


def image_model_class(model_config) -> type | None:
    """The model class of ``model_config`` when it takes images, else None (read from the
    folder's config.json and the registry: no weights, no full config load)."""
    from vllm.model_executor.model_loader import _config_json, resolve_model
    from vllm.model_executor.models.registry import ModelRegistry

    path = resolve_model(
        model_config.model, model_config.revision, model_config.download_dir,
        model_config.hf_token,
    )  # fmt: skip
    config = _config_json(path)
    for arch in config.get("architectures") or ():
        if arch in ModelRegistry.models:
            cls = ModelRegistry._load(arch)
            takes = getattr(cls, "takes_images", None)  # per checkpoint (Qwen-VL's)
            images = takes(config) if takes is not None else getattr(cls, "supports_images", False)
            return cls if images else None
    return None


class ImageInputProcessor:
    """A model's image inputs: ``process(prompt_ids, images)`` -> (the prompt with its
    placeholders expanded, one ``MultiModalFeature`` per image).

    Three prompt layouts, as the model class says (``image_layout``):

    - whole (LLaVA): an image is one tile, its placeholder ``tokens_per_image`` image
      tokens;
    - tiled (Idefics3, SmolVLM): the image processor cuts an image into R x C tiles and
      adds the whole image as a last tile; the placeholder becomes transformers'
      prompt string for them, each tile's ``<fake_token_around_image><row_r_col_c>`` then
      its image tokens, a newline after each row, and the global tile between
      ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``;
      only the image tokens take embeddings (``is_embed``);
    - grid (Qwen2-VL, Qwen2.5-VL): the image processor sizes an image to a grid of patches
      (t, h, w); its placeholder becomes t * h * w / merge**2 image tokens, whose M-RoPE
      positions follow the merged grid (``mrope_grid``).
    """

    def __init__(self, model_config, tokenizer, model_cls: type) -> None:
        from vllm.model_executor.model_loader import hf_config_of, resolve_model

        self.path = resolve_model(
            model_config.model, model_config.revision, model_config.download_dir,
            model_config.hf_token,
        )  # fmt: skip
        hf_config = hf_config_of(model_config)
        # "whole" (LLaVA), "tiled" (SmolVLM, Idefics3) or "grid" (Qwen2-VL): class docstring.
        self.layout = getattr(model_cls, "image_layout", "whole")
        module = importlib.import_module(model_cls.__module__)
        if self.layout == "grid":
            self.image_token_id, self.merge = module.qwen_vl_image_layout(hf_config)
            self.tokens_per_tile = 0  # each image's own: its grid's
        else:
            self.image_token_id, self.tokens_per_tile = module.image_token_layout(hf_config)
        limits = model_config.limit_mm_per_prompt or {}
        self.limit = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
        self.tokenizer = tokenizer
        # The text that stands for one image in a prompt (a chat template's placeholder).
        self.placeholder: str | None = None
        if tokenizer is not None:
            self.placeholder = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self._image_processor = None  # loaded by the first image
        self._tile_prompts: dict[tuple[int, int], list[int]] = {}  # (R, C) -> its ids

    @classmethod
    def for_model(cls, model_config, tokenizer) -> ImageInputProcessor | None:
        """The processor of a model that takes images; None for a text-only model."""
        model_cls = image_model_class(model_config)
        return None if model_cls is None else cls(model_config, tokenizer, model_cls)

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            try:
                # The PIL backend: the same pixels whether or not torchvision is installed.
                self._image_processor = AutoImageProcessor.from_pretrained(self.path, backend="pil")
            except (OSError, ValueError) as e:
                raise VLLMValidationError(
                    f"the model folder {self.path} has no image processor config "
                    f"(preprocessor_config.json): {e}",
                    PARAM,
                ) from e
        return self._image_processor

    def process(
        self, prompt_ids: list[int], images: list[Any]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        if len(images) > self.limit:
            raise VLLMValidationError(
                f"at most {self.limit} images a prompt (--limit-mm-per-prompt), got {len(images)}",
                PARAM,
            )
        slots = [i for i, t in enumerate(prompt_ids) if t == self.image_token_id]
        if len(slots) != len(images):
            named = f" ({self.placeholder!r})" if self.placeholder else ""
            raise VLLMValidationError(
                f"{len(images)} images need {len(images)} image placeholder tokens{named} in "
                f"the prompt, one where each image goes, in order; it holds {len(slots)}",
                PARAM,
            )
        if self.layout == "tiled" and self.tokenizer is None:
            raise VLLMValidationError(
                "this model's image prompts are built with its tokenizer, which "
                "--skip-tokenizer-init leaves out",
                PARAM,
            )
        ids: list[int] = []
        features = []
        last = 0
        for slot, image in zip(slots, images, strict=True):
            ids += prompt_ids[last:slot]
            feature, image_ids = getattr(self, f"_{self.layout}")(image, len(ids))
            features.append(feature)
            ids += image_ids
            last = slot + 1
        ids += prompt_ids[last:]
        return ids, features

    def _whole(self, image, offset: int) -> tuple[MultiModalFeature, list[int]]:
        """The image as one (1, 3, H, W) tile at prompt position ``offset``, and the image
        tokens that stand for it."""
        pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        pixels = pixels.float()
        n = self.tokens_per_tile
        return MultiModalFeature("image", pixels, offset, n, content_hash(pixels)), [
            self.image_token_id
        ] * n

    def _grid(self, image, offset: int) -> tuple[MultiModalFeature, list[int]]:
        """Qwen2-VL's: the image's (patches, patch values) and patch grid (t, h, w), and
        its t * h * w / merge**2 image tokens, whose M-RoPE positions follow the merged
        grid."""
        out = self.image_processor(images=[image], return_tensors="pt")
        patches = out["pixel_values"].float()
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        m = self.merge
        n = t * h * w // (m * m)
        feature = MultiModalFeature(
            "image", patches, offset, n, content_hash(patches),
            grid_thw=(t, h, w), mrope_grid=(t, h // m, w // m),
        )  # fmt: skip
        return feature, [self.image_token_id] * n

    def _tiled(self, image, offset: int) -> tuple[MultiModalFeature, list[int]]:
        """(R * C + 1, 3, H, W) tiles, the whole image last (one tile when the processor
        does not split it), and the prompt ids that stand for them: its image tokens take
        the embeddings (``is_embed``), its markers are text."""
        out = self.image_processor(images=[image], return_tensors="pt", return_row_col_info=True)
        tiles = out["pixel_values"][0].float()  # one image: no padding tile
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        key = (rows, cols)
        if key not in self._tile_prompts:
            self._tile_prompts[key] = self.tokenizer.encode(
                self._tile_text(rows, cols), add_special_tokens=False
            )
        image_ids = self._tile_prompts[key]
        found = sum(t == self.image_token_id for t in image_ids)
        if found != tiles.shape[0] * self.tokens_per_tile:  # the tokenizer lacks a marker
            raise VLLMValidationError(
                f"the image's prompt holds {found} image tokens for {tiles.shape[0]} tiles "
                f"of {self.tokens_per_tile}: the tokenizer does not keep the markers whole",
                PARAM,
            )
        mask = [t == self.image_token_id for t in image_ids]
        feature = MultiModalFeature(
            "image", tiles, offset, len(image_ids), content_hash(tiles), mask
        )
        return feature, image_ids

    def _tile_text(self, rows: int, cols: int) -> str:
        """transformers' prompt string for an image of ``rows`` x ``cols`` tiles."""
        fake, image = "<fake_token_around_image>", self.placeholder * self.tokens_per_tile
        whole = f"{fake}<global-img>{image}{fake}"
        if rows == 0 and cols == 0:
            return whole
        text = ""
        for r in range(1, rows + 1):
            text += "".join(f"{fake}<row_{r}_col_{c}>{image}" for c in range(1, cols + 1))
            text += "\n"
        return f"{text}\n{whole}"


def content_hash(data: torch.Tensor) -> str:
    """sha256 of an encoder input's shape, dtype and values."""
    h = hashlib.sha256(f"{tuple(data.shape)}|{data.dtype}".encode())
    h.update(data.contiguous().numpy().tobytes())
    return h.hexdigest()


def images_of(multi_modal_data: Any) -> list[Any]:
    """The images of an ``LLM.generate`` / engine ``multi_modal_data`` value
    (``{"image": image or [images]}``, PIL images), checked; ``VLLMValidationError``
    naming ``multi_modal_data`` otherwise."""
    if multi_modal_data is None:
        return []
    if not isinstance(multi_modal_data, dict):
        raise VLLMValidationError(
            f"multi_modal_data must be a dict like {{'image': <PIL image or list>}}, got "
            f"{type(multi_modal_data).__name__}",
            PARAM,
        )
    unknown = sorted(set(multi_modal_data) - set(MODALITIES))
    if unknown:
        raise VLLMValidationError(
            f"multi_modal_data: modality {unknown[0]!r} is not supported (only 'image')",
            PARAM,
        )
    images = multi_modal_data.get("image")
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        images = [images]
    from PIL import Image

    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise VLLMValidationError(
                f"multi_modal_data['image'][{i}] must be a PIL image, got {type(image).__name__}",
                PARAM,
            )
    return [image.convert("RGB") for image in images]
