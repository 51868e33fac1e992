"""Idefics3 and SmolVLM (``Idefics3ForConditionalGeneration``,
``SmolVLMForConditionalGeneration``: one architecture under two names): a SigLIP-style
vision encoder (``idefics3_vision.py``), a connector, and a Llama language model
(``text_config``; SmolLM2 in SmolVLM, Llama 3 in Idefics3).

The image processor cuts an image into full ``image_size`` tiles (rows x cols of them, then
the whole image resized to one tile, last); each tile becomes ``image_seq_len`` rows of
embeddings (``embed_images``), independently of the others: the encoder's last hidden
states (after ``post_layernorm``), pixel-shuffled by ``scale_factor`` (each
``scale_factor`` x ``scale_factor`` block of patches concatenated on the feature dimension
into one position) and projected by ``connector.modality_projection.proj`` (no bias). The
prompt holds that many image tokens per tile (``image_token_layout``) among the text of
the tile markers; the engine writes the tiles' rows over their embeddings
(``embed_input_ids``) and runs the language model on the result
(``forward(..., inputs_embeds=...)``). The language model is ``LlamaForCausalLM`` itself.

Tensors: one layout on the Hub, in what transformers 5 saves and in what it holds in
memory: ``model.vision_model.``, ``model.connector.modality_projection.proj.weight``,
``model.text_model.`` (the Llama's ``model.``) and ``lm_head.weight``. Whether the output
head is tied to the embeddings is the top-level config's ``tie_word_embeddings``, as in
transformers (not ``text_config``'s).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.idefics3_vision import Idefics3VisionArch, Idefics3VisionModel
from vllm.model_executor.models.llama import LlamaArch, LlamaForCausalLM
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.utils import config_from_dict

TEXT_PREFIX = "text_model."  # the language model's tensors, after the leading "model."


def _config(hf_config: Any) -> Any:
    return config_from_dict(hf_config, {"idefics3": "Idefics3Config", "smolvlm": "SmolVLMConfig"})


def image_token_layout(hf_config: Any) -> tuple[int, int]:
    """(the image token id, tokens per tile) of an Idefics3 or SmolVLM config (transformers'
    or the dict of its config.json): ``image_token_id``, and the processor's
    ``image_seq_len``, ``(image_size // patch_size) ** 2 // scale_factor ** 2`` (64 for
    SmolVLM-256M: 512-pixel tiles, 16-pixel patches, scale factor 4). An image of R x C
    tiles takes ``R * C + 1`` times that many (its global tile last). ``ValueError`` when
    the patch grid does not divide by ``scale_factor``."""
    config = _config(hf_config)
    grid = Idefics3VisionArch.from_hf(config.vision_config).patches_per_side
    scale = config.scale_factor
    if scale < 1 or grid % scale:
        raise ValueError(
            f"scale_factor {scale} does not divide the vision encoder's {grid} patches a side"
        )
    return config.image_token_id, (grid // scale) ** 2


@dataclass(frozen=True)
class Idefics3Arch(LlamaArch):
    """The language model's arch, and the vision side's."""

    # None only as a dataclass default (fields after LlamaArch's need one): from_hf sets it.
    vision: Idefics3VisionArch | None = None
    scale_factor: int = 2

    @classmethod
    def from_hf(cls, config: Any) -> Idefics3Arch:
        text = config.get_text_config()
        text_cls, text_arch = ModelRegistry.resolve_model_cls(text)
        # transformers' model embeds and scales nothing of its own: Granite's scalars (and any
        # other family's forward) would not match it.
        if text_cls is not LlamaForCausalLM or text.model_type == "granite":
            raise ValueError(
                f"text_config {text_arch} ({text.model_type}): Idefics3 and SmolVLM run the "
                "dense Llama-family language models, Granite excepted"
            )
        image_token_layout(config)  # the scale factor divides the patch grid
        base = LlamaArch.from_hf(text)
        # transformers ties the head by the top-level flag: the text model has no head.
        base = dataclasses.replace(base, tie_word_embeddings=bool(config.tie_word_embeddings))
        return cls(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaArch)},
            vision=Idefics3VisionArch.from_hf(config.vision_config),
            scale_factor=config.scale_factor,
        )


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """(n, grid * grid, d) row-major patches -> (n, (grid / scale) ** 2, d * scale ** 2):
    each ``scale`` x ``scale`` block of patches becomes one position, row-major over the
    blocks; its features are the block's patches concatenated row-major (the patch at row
    ``i``, column ``j`` of the block at offset ``(i * scale + j) * d``), as transformers'
    ``Idefics3Connector.pixel_shuffle`` orders them."""
    n, seq, d = x.shape
    grid = round(seq**0.5)
    blocks = grid // scale
    x = x.view(n, blocks, scale, blocks, scale, d)  # (n, block row, i, block col, j, d)
    x = x.permute(0, 1, 3, 2, 4, 5)  # (n, block row, block col, i, j, d)
    return x.reshape(n, blocks * blocks, scale * scale * d)


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, a: Idefics3Arch) -> None:
        super().__init__()
        width = a.vision.hidden_size * a.scale_factor**2
        self.proj = nn.Linear(width, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    """Pixel shuffle, then ``modality_projection`` into the language model's width."""

    def __init__(self, a: Idefics3Arch) -> None:
        super().__init__()
        self.scale_factor = a.scale_factor
        self.modality_projection = Idefics3SimpleMLP(a)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """(num_tiles, num_patches, vision hidden) -> (num_tiles, image_seq_len, hidden)."""
        return self.modality_projection(pixel_shuffle(features, self.scale_factor))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The language model (every ``LlamaForCausalLM`` method, ``forward`` taking
    ``inputs_embeds``), with ``vision_model`` and ``connector`` beside it (module
    docstring). SmolVLM's checkpoints run with this class too."""

    gguf_layout: ClassVar[Any] = None
    supports_images: ClassVar[bool] = True
    # An image's prompt is its tiles' (vllm.multimodal.processing): markers and rows.
    image_layout: ClassVar[str] = "tiled"

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Idefics3Arch:
        return Idefics3Arch.from_hf(hf_config)

    def __init__(self, arch: Idefics3Arch) -> None:
        super().__init__(arch)
        self.vision_model = Idefics3VisionModel(arch.vision)
        self.connector = Idefics3Connector(arch)

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_tiles, 3, image_size, image_size) pixels of full tiles (any float dtype, any
        device; the tiles of any number of images, concatenated) -> (num_tiles,
        image_seq_len, hidden) embeddings in the model's dtype, on its device: each tile's
        placeholder rows, in order, each tile encoded alone. ``ValueError`` for tiles of
        another shape."""
        return self.connector(self.vision_model(pixel_values))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The language model's tensors (``LlamaForCausalLM.load_weights``), the vision
        model's and the connector's, from the checkpoint's layout (module docstring; the
        leading ``model.`` optional)."""
        text, vision, connector = {}, {}, {}
        for key, tensor in sd.items():
            name = key.removeprefix("model.")
            if name.startswith(TEXT_PREFIX):
                text["model." + name.removeprefix(TEXT_PREFIX)] = tensor
            elif name.startswith("vision_model."):
                vision[name.removeprefix("vision_model.")] = tensor
            elif name.startswith("connector."):
                connector[name.removeprefix("connector.")] = tensor
            elif key == "lm_head.weight":
                text[key] = tensor
        if not text:
            raise ValueError(
                f"no language-model tensors in the checkpoint (under model.{TEXT_PREFIX})"
            )
        super().load_weights(text)
        self.vision_model.load_weights(vision)
        self.connector.load_state_dict(connector)
