"""Helpers shared by the model families."""

from __future__ import annotations

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
