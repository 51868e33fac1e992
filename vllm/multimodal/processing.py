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
    for arch in _config_json(path).get("architectures") or ():
        if arch in ModelRegistry.models:
            cls = ModelRegistry._load(arch)
            return cls if getattr(cls, "supports_images", False) else None
    return None


class ImageInputProcessor:
    """A model's image inputs: ``process(prompt_ids, images)`` -> (the prompt with its
    placeholders expanded, one ``MultiModalFeature`` per image)."""

    def __init__(self, model_config, tokenizer) -> None:
        from vllm.model_executor.model_loader import hf_config_of, resolve_model
        from vllm.model_executor.models.llava import image_token_layout

        self.path = resolve_model(
            model_config.model, model_config.revision, model_config.download_dir,
            model_config.hf_token,
        )  # fmt: skip
        self.image_token_id, self.tokens_per_image = image_token_layout(hf_config_of(model_config))
        self.limit = (model_config.limit_mm_per_prompt or {}).get("image", DEFAULT_LIMIT_PER_PROMPT)
        # The text that stands for one image in a prompt (a chat template's placeholder).
        self.placeholder: str | None = None
        if tokenizer is not None:
            self.placeholder = tokenizer.convert_ids_to_tokens(self.image_token_id)
        self._image_processor = None  # loaded by the first image

    @classmethod
    def for_model(cls, model_config, tokenizer) -> ImageInputProcessor | None:
        """The processor of a model that takes images; None for a text-only model."""
        if image_model_class(model_config) is None:
            return None
        return cls(model_config, tokenizer)

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            try:
                # The PIL backend: the same pixels whether or not torchvision is installed.
                self._image_processor = AutoImageProcessor.from_pretrained(
                    self.path, backend="pil"
                )
            except (OSError, ValueError) as e:
                raise VLLMValidationError(
                    f"the model folder {self.path} has no image processor config "
                    f"(preprocessor_config.json): {e}",
                    PARAM,
                ) from e
        return self._image_processor

    def pixel_values(self, images: list[Any]) -> torch.Tensor:
        """``(len(images), 3, H, W)`` fp32: the images as the model's processor prepares
        them."""
        out = self.image_processor(images=images, return_tensors="pt")["pixel_values"]
        return out.float()

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
        pixels = self.pixel_values(images)
        ids: list[int] = []
        features = []
        last = 0
        n = self.tokens_per_image
        for slot, data in zip(slots, pixels, strict=True):
            ids += prompt_ids[last:slot]
            features.append(MultiModalFeature("image", data, len(ids), n, content_hash(data)))
            ids += [self.image_token_id] * n
            last = slot + 1
        ids += prompt_ids[last:]
        return ids, features


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
