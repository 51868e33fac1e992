"""LLaVA-1.5 and its layout (``LlavaForConditionalGeneration``): a CLIP vision tower
(``clip.py``), a two-layer projector into the language model's width, and a Llama-family
language model (``text_config``: Llama, Mistral, Qwen2...).

An image becomes ``tokens_per_image`` rows of embeddings (``embed_images``): the tower's
hidden states after ``vision_feature_layer`` (one layer, or several concatenated on the
feature dimension), without the CLS position for the "default"
``vision_feature_select_strategy`` ("full" keeps it), through ``linear_1``, the
``projector_hidden_act``, ``linear_2``. The prompt holds that many image tokens
(``image_token_layout``) per image; the engine writes the image's rows over their
embeddings (``embed_input_ids``) and runs the language model on the result
(``forward(..., inputs_embeds=...)``). The language model is ``LlamaForCausalLM`` itself,
so its attention backends, decode graphs, quantization and LoRA apply unchanged.

Tensors: the Hub's layout (``vision_tower.vision_model.``, ``multi_modal_projector.``,
``language_model.model.``, ``language_model.lm_head``), the one transformers 5 saves
(the tower's without ``vision_model.``) and the one it holds in memory
(``model.vision_tower.``, ``model.multi_modal_projector.``, ``model.language_model.``,
``lm_head``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.clip import CLIPVisionArch, CLIPVisionModel, activation
from vllm.model_executor.models.llama import LlamaArch, LlamaForCausalLM, Phi3ForCausalLM
from vllm.model_executor.models.registry import ModelRegistry
from vllm.model_executor.models.utils import config_from_dict, language_model_tensors


def _config(hf_config: Any) -> Any:
    return config_from_dict(hf_config, {"llava": "LlavaConfig"})


def image_token_layout(hf_config: Any) -> tuple[int, int]:
    """(the image token id, tokens per image) of a llava config (a transformers
    ``LlavaConfig`` or the dict of its config.json): ``image_token_index`` (alias
    ``image_token_id``), and the tower's patches, ``(image_size // patch_size) ** 2``, plus
    the CLS position under the "full" ``vision_feature_select_strategy`` (transformers
    refuses any but it and "default")."""
    config = _config(hf_config)
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    return config.image_token_index, patches + (config.vision_feature_select_strategy == "full")


@dataclass(frozen=True)
class LlavaArch(LlamaArch):
    """The language model's arch, and the vision side's."""

    # None only as a dataclass default (fields after LlamaArch's need one): from_hf sets it.
    vision: CLIPVisionArch | None = None  # built to the deepest feature layer read
    # Indices into the tower's hidden states (0: its normed embeddings, k: after layer k),
    # non-negative, concatenated in this order.
    feature_layers: tuple[int, ...] = ()
    keep_cls: bool = False  # vision_feature_select_strategy "full"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True

    @classmethod
    def from_hf(cls, config: Any) -> LlavaArch:
        text = config.get_text_config()
        text_cls, text_arch = ModelRegistry.resolve_model_cls(text)
        # Granite's scalars are left out: transformers' LLaVA scales its image rows by the
        # embedding multiplier and its logits by nothing, unlike a Granite model.
        if text_cls not in (LlamaForCausalLM, Phi3ForCausalLM) or text.model_type == "granite":
            raise ValueError(
                f"text_config {text_arch} ({text.model_type}): LLaVA runs the dense "
                "Llama-family language models, Granite excepted"
            )
        base = LlamaArch.from_hf(text)
        vision = config.vision_config
        layer = config.vision_feature_layer
        asked = (layer,) if isinstance(layer, int) else tuple(layer)
        n = vision.num_hidden_layers
        feature_layers = tuple(i if i >= 0 else n + 1 + i for i in asked)
        if not asked or not all(0 <= i <= n for i in feature_layers):
            raise ValueError(
                f"vision_feature_layer {layer!r}: each must index the tower's {n + 1} hidden "
                f"states (-{n + 1} to {n})"
            )
        activation(config.projector_hidden_act, "projector_hidden_act")
        return cls(
            **{f.name: getattr(base, f.name) for f in fields(LlamaArch)},
            vision=CLIPVisionArch.from_hf(vision, max(feature_layers)),
            feature_layers=feature_layers,
            keep_cls=config.vision_feature_select_strategy == "full",
            projector_hidden_act=config.projector_hidden_act,
            projector_bias=config.multimodal_projector_bias,
        )


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, a: LlavaArch) -> None:
        super().__init__()
        width = a.vision.hidden_size * len(a.feature_layers)
        self.linear_1 = nn.Linear(width, a.hidden_size, bias=a.projector_bias)
        self.act = activation(a.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(a.hidden_size, a.hidden_size, bias=a.projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The language model (every ``LlamaForCausalLM`` method, ``forward`` taking
    ``inputs_embeds``), with ``vision_tower`` and ``multi_modal_projector`` beside it
    (module docstring)."""

    gguf_layout: ClassVar[Any] = None
    supports_images: ClassVar[bool] = True

    @staticmethod
    def arch_from_hf(hf_config: Any) -> LlavaArch:
        return LlavaArch.from_hf(hf_config)

    def __init__(self, arch: LlavaArch) -> None:
        super().__init__(arch)
        self.vision_tower = CLIPVisionModel(arch.vision)
        self.multi_modal_projector = LlavaMultiModalProjector(arch)

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_images, 3, image_size, image_size) pixels (any float dtype, any device) ->
        (num_images, tokens_per_image, hidden) embeddings in the model's dtype, on its
        device: the rows of each image's placeholder tokens, in order, to be written over
        those of ``embed_input_ids``."""
        a = self.arch
        features = self.vision_tower(pixel_values, a.feature_layers)
        if not a.keep_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The language model's tensors (``LlamaForCausalLM.load_weights``), the tower's and
        the projector's, from any of the three layouts (module docstring)."""
        super().load_weights(language_model_tensors(sd))
        tower, projector = {}, {}
        for key, tensor in sd.items():
            key = key.removeprefix("model.")
            if key.startswith("vision_tower."):
                tower[key.removeprefix("vision_tower.")] = tensor
            elif key.startswith("multi_modal_projector."):
                projector[key.removeprefix("multi_modal_projector.")] = tensor
        self.vision_tower.load_weights(tower)
        self.multi_modal_projector.load_state_dict(projector)
