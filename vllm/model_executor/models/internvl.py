"""InternVL3 and InternVL3.5 as transformers runs them (``InternVLForConditionalGeneration``:
the ``-hf`` / ``-HF`` checkpoints): an InternViT vision tower (``internvl_vision.py``), a
pixel-shuffle projector, and a Qwen2, Qwen3 or Llama language model (``text_config``).

The image processor (transformers' ``GotOcr2ImageProcessor`` with ``crop_to_patches``, as
``InternVLProcessor`` calls it) cuts an image into a grid of ``image_size`` tiles of the
aspect ratio nearest the image's (``min_patches`` to ``max_patches`` of them) and, when
there is more than one, adds the whole image resized to one tile, last. Each tile becomes
``tokens_per_tile`` rows (``embed_images``), independently of the others: the tower's
hidden state after ``vision_feature_layer`` without the CLS position, its patch grid
pixel-shuffled by ``1 / downsample_ratio`` (each square block of patches concatenated on
the feature dimension, as Idefics3's connector orders them), then ``layer_norm``,
``linear_1``, ``projector_hidden_act``, ``linear_2``. The prompt names an image with one
``<IMG_CONTEXT>`` (the chat template's ``'<IMG_CONTEXT>\\n'``); it becomes ``<img>``, that
token ``tokens_per_tile`` times per tile, ``</img>`` (``image_context_layout``; the
"framed_tiles" layout of vllm/multimodal/processing.py). The engine writes the tiles' rows
over the context tokens' embeddings (``embed_input_ids``) and runs the language model on
the result (``forward(..., inputs_embeds=...)``); the language model is
``LlamaForCausalLM`` itself.

Tensors: what transformers 5 saves (and the Hub's ``-hf`` checkpoints hold):
``vision_tower.``, ``multi_modal_projector.``, ``language_model.model.``,
``language_model.lm_head.weight``; and what it holds in memory (``model.vision_tower.``,
``model.multi_modal_projector.``, ``model.language_model.``, ``lm_head.weight``). The output
head: transformers ties it to the embeddings by the top-level ``tie_word_embeddings``
(True by default) but keeps a checkpoint's own head when it holds one that differs, so
the head is tied here only where both that flag and ``text_config``'s say so, and is
otherwise read from the checkpoint (the embeddings where it holds none).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.clip import activation
from vllm.model_executor.models.idefics3 import pixel_shuffle
from vllm.model_executor.models.internvl_vision import InternVLVisionArch, InternVLVisionModel
from vllm.model_executor.models.llama import LlamaArch, LlamaForCausalLM
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.utils import config_from_dict, language_model_tensors


def _config(hf_config: Any) -> Any:
    return config_from_dict(hf_config, {"internvl": "InternVLConfig"})


@dataclass(frozen=True)
class ImageContextLayout:
    """How InternVL writes an image in a prompt: the prompt names it with one
    ``image_token_id`` (``<IMG_CONTEXT>``); ``InternVLProcessor`` turns that into
    ``start_token``, ``image_token_id`` x (``tokens_per_tile`` x the image's tiles),
    ``end_token``, of which the context tokens take the image's rows. The config names
    no id for the frame's tokens: the tokenizer's (its ``start_image_token`` and
    ``end_image_token``, these by default)."""

    image_token_id: int
    tokens_per_tile: int
    start_token: str = "<img>"
    end_token: str = "</img>"


def _shuffle(config: Any) -> tuple[int, int]:
    """(the tower's patches a side, the pixel shuffle's block side ``1 /
    downsample_ratio``); ``ValueError`` when that is not an integer dividing the former."""
    grid = InternVLVisionArch.from_hf(config.vision_config, 0, False).patches_per_side
    ratio = config.downsample_ratio
    scale = round(1 / ratio) if ratio > 0 else 0
    if scale < 1 or abs(scale * ratio - 1) > 1e-6 or grid % scale:
        raise ValueError(
            f"downsample_ratio {ratio}: its inverse must be an integer dividing the vision "
            f"tower's {grid} patches a side"
        )
    return grid, scale


def image_context_layout(hf_config: Any) -> ImageContextLayout:
    """The image layout of an InternVL config (transformers' ``InternVLConfig`` or the dict
    of its config.json): ``image_token_id``, and the rows a tile makes, ``(image_size //
    patch_size) ** 2 * downsample_ratio ** 2`` (256 for InternVL3: 448-pixel tiles,
    14-pixel patches, ratio 0.5), what the processor's ``image_seq_length`` must be."""
    config = _config(hf_config)
    grid, scale = _shuffle(config)
    return ImageContextLayout(config.image_token_id, (grid // scale) ** 2)


@dataclass(frozen=True)
class InternVLArch(LlamaArch):
    """The language model's arch, and the vision side's."""

    # None only as a dataclass default (fields after LlamaArch's need one): from_hf sets it.
    vision: InternVLVisionArch | None = None  # built up to the feature layer
    scale_factor: int = 2  # 1 / downsample_ratio
    projector_hidden_act: str = "gelu"

    @classmethod
    def from_hf(cls, config: Any) -> InternVLArch:
        text = config.get_text_config()
        text_cls, text_arch = ModelRegistry.resolve_model_cls(text)
        # transformers' InternVL scatters the image rows into the embeddings and applies
        # its own lm_head: Granite's scalars (and any other family's forward) would differ.
        if text_cls is not LlamaForCausalLM or text.model_type == "granite":
            raise ValueError(
                f"text_config {text_arch} ({text.model_type}): InternVL runs the dense "
                "Llama-family language models (Qwen2, Qwen3, Llama), Granite excepted"
            )
        if config.vision_feature_select_strategy != "default":
            # "full" keeps the CLS row, which transformers' square reshape cannot take.
            raise ValueError(
                f"vision_feature_select_strategy {config.vision_feature_select_strategy!r} "
                "is not supported (only 'default': the CLS position dropped)"
            )
        vision = config.vision_config
        layer, n = config.vision_feature_layer, vision.num_hidden_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not -n - 1 <= layer <= n:
            raise ValueError(
                f"vision_feature_layer {layer!r}: one int indexing the tower's {n + 1} hidden "
                f"states (-{n + 1} to {n})"
            )
        activation(config.projector_hidden_act, "projector_hidden_act")
        base = LlamaArch.from_hf(text)
        tie = bool(config.tie_word_embeddings) and base.tie_word_embeddings
        base = dataclasses.replace(base, tie_word_embeddings=tie)
        return cls(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaArch)},
            # -1 reads transformers' last_hidden_state (after the tower's layernorm); any
            # other index its hidden_states, unnormed.
            vision=InternVLVisionArch.from_hf(vision, layer % (n + 1), layer == -1),
            scale_factor=_shuffle(config)[1],
            projector_hidden_act=config.projector_hidden_act,
        )


class InternVLMultiModalProjector(nn.Module):
    def __init__(self, a: InternVLArch) -> None:
        super().__init__()
        width = a.vision.hidden_size * a.scale_factor**2
        self.layer_norm = nn.LayerNorm(width)  # eps 1e-5: torch's default, as transformers'
        self.linear_1 = nn.Linear(width, a.hidden_size)
        self.act = activation(a.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(a.hidden_size, a.hidden_size)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(features))))


class InternVLForConditionalGeneration(LlamaForCausalLM):
    """The language model (every ``LlamaForCausalLM`` method, ``forward`` taking
    ``inputs_embeds``), with ``vision_tower`` and ``multi_modal_projector`` beside it
    (module docstring)."""

    gguf_layout: ClassVar[Any] = None
    supports_images: ClassVar[bool] = True
    # An image's prompt: its tiles' context tokens between <img> and </img>
    # (vllm.multimodal.processing).
    image_layout: ClassVar[str] = "framed_tiles"

    @staticmethod
    def arch_from_hf(hf_config: Any) -> InternVLArch:
        return InternVLArch.from_hf(_config(hf_config))

    def __init__(self, arch: InternVLArch) -> None:
        super().__init__(arch)
        self.vision_tower = InternVLVisionModel(arch.vision)
        self.multi_modal_projector = InternVLMultiModalProjector(arch)

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_tiles, 3, image_size, image_size) pixels of tiles (any float dtype, any
        device; the tiles of any number of images, concatenated) -> (num_tiles,
        tokens_per_tile, hidden) embeddings in the model's dtype, on its device: each
        tile's context-token rows, in order, each tile encoded alone. ``ValueError`` for
        tiles of another shape."""
        features = self.vision_tower(pixel_values)[:, 1:]  # the CLS position dropped
        features = pixel_shuffle(features, self.arch.scale_factor)
        return self.multi_modal_projector(features)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The language model's tensors (``LlamaForCausalLM.load_weights``), the tower's and
        the projector's, from either layout (module docstring). ``ValueError`` when the
        checkpoint holds no vision tower tensors."""
        super().load_weights(language_model_tensors(sd))
        vision: dict[str, dict[str, torch.Tensor]] = {
            "vision_tower": {},
            "multi_modal_projector": {},
        }
        for key, tensor in sd.items():
            module, _, name = key.removeprefix("model.").partition(".")
            if module in vision:
                vision[module][name] = tensor
        if not vision["vision_tower"]:
            raise ValueError(
                "no vision tower tensors in the checkpoint (looked under vision_tower. and "
                "model.vision_tower.)"
            )
        self.vision_tower.load_weights(vision["vision_tower"])
        self.multi_modal_projector.load_state_dict(vision["multi_modal_projector"])
