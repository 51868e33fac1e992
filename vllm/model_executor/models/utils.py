"""Helpers shared by the model families."""

from __future__ import annotations

from typing import Any

import torch

# Where a multimodal checkpoint (Gemma 3, Mistral 3: ``*ForConditionalGeneration``) keeps
# its language model: the Hub's layout, then transformers 5's.
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


def language_model_tensors(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors of a multimodal checkpoint, named as its text-only
    checkpoint names them (``model.layers...``, ``lm_head.weight``); the vision tower and
    projector left out. ``ValueError`` when there are none."""
    text = {}
    for key, tensor in sd.items():
        prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if key.startswith(p)), None)
        if prefix is not None:
            text["model." + key.removeprefix(prefix)] = tensor
        elif key in LM_HEAD_KEYS:
            text["lm_head.weight"] = tensor
    if not text:
        raise ValueError(
            "no language-model tensors in the checkpoint (looked under "
            f"{' and '.join(LANGUAGE_MODEL_PREFIXES)})"
        )
    return text


def config_from_dict(hf_config: Any, classes: dict[str, str]) -> Any:
    """A multimodal config as transformers reads it: ``hf_config`` itself, or built from
    the plain dict of its config.json (the sub-configs' defaults filled in) by the
    transformers config class ``classes`` names for its ``model_type``. ``ValueError`` for
    another model_type."""
    if not isinstance(hf_config, dict):
        return hf_config
    import transformers

    model_type = hf_config.get("model_type")
    if model_type not in classes:
        raise ValueError(f"model_type {model_type!r} is not one of {', '.join(classes)}")
    return getattr(transformers, classes[model_type]).from_dict(hf_config)


def takes_images(hf_config: Any) -> bool:
    """Whether the checkpoint of ``hf_config`` (transformers' config or the dict of its
    config.json) has a vision tower: a dict without a ``vision_config`` does not
    (transformers would fill in a default one)."""
    if isinstance(hf_config, dict):
        return hf_config.get("vision_config") is not None
    return getattr(hf_config, "vision_config", None) is not None
