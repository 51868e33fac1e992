"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): Qwen3-VL
(``QwenVLForConditionalGeneration`` in ``llama.py``: its vision tower, interleaved M-RoPE
and DeepStack) whose language model is Qwen3-MoE's (``moe.py``: a ``SparseMoeBlock`` in
the layers ``decoder_sparse_step`` and ``mlp_only_layers`` leave sparse, the dense MLP in
the others).

transformers' router (``Qwen3VLMoeTextTopKRouter``) always divides the top-k softmax
probabilities by their sum: the text config has no ``norm_topk_prob``. The experts are
stacked, ``experts.gate_up_proj`` and ``experts.down_proj``: (E, [gate; up], H) and
(E, H, I) as transformers 5 writes them, each expert transposed in the Hub's checkpoints
(transformers 4's); ``moe.stacked_experts`` reads both, ``moe.expert_weights`` also one
tensor per expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from vllm.model_executor.models.llama import (
    QwenVLForConditionalGeneration,
    qwen_vl_image_layout,
)
from vllm.model_executor.models.moe import MoeArch, MoeForCausalLM
from vllm.model_executor.models.qwen2_vl_vision import QwenVLArch

__all__ = ["QwenVLMoeArch", "Qwen3VLMoeForConditionalGeneration", "qwen_vl_image_layout"]


@dataclasses.dataclass(frozen=True)
class QwenVLMoeArch(QwenVLArch, MoeArch):
    """The language model's experts (``MoeArch``) with the M-RoPE sections and the tower
    (``QwenVLArch``)."""


class Qwen3VLMoeForConditionalGeneration(QwenVLForConditionalGeneration, MoeForCausalLM):
    """``QwenVLForConditionalGeneration`` (images, M-RoPE, DeepStack, both checkpoint
    layouts) with ``MoeForCausalLM``'s feed-forward (``make_mlp``, ``load_mlp``)."""

    _TEXT_FAMILIES: ClassVar[dict[str, str]] = {"qwen3_vl_moe_text": "qwen3_moe"}

    @classmethod
    def arch_from_hf(cls, hf_config: Any) -> QwenVLMoeArch:
        text = cls.text_config(hf_config)
        # transformers ties the output head by the top-level flag, not text_config's
        # (whose default is True where the checkpoints' is False).
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        arch = dataclasses.replace(MoeArch.from_hf(text), norm_topk_prob=True)
        return QwenVLMoeArch.from_text(arch, hf_config)
