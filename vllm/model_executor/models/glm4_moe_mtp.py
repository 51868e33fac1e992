"""GLM-4.5/4.6's multi-token-prediction layer as a draft head (``models/mtp.py``): a
GLM-4.5 decoder layer (``models/moe.py``: q/k/v biases, optional q/k norms, half the head
rotated; the experts from ``first_k_dense_replace`` on, so the MTP layer is sparse). Its
next step reads the stream before ``shared_head.norm``, as vLLM's ``Glm4MoeMTP`` feeds it
back. GLM's files hold no copies of the embeddings or the output head under the layer's
prefix: the target's are shared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.model_executor.models.llama import (
    LlamaLayer,
    RotaryEmbedding,
    layer_attention,
    load_projections,
)
from vllm.model_executor.models.moe import MoeArch, SparseMoeBlock, load_moe_block
from vllm.model_executor.models.mtp import MultiTokenPredictor, mtp_head_class


@dataclass(frozen=True)
class Glm4MoeMTPArch(MoeArch):
    """The MTP layer's arch: the target's shapes, one layer, and its index."""

    mtp_layer: int = 0


class Glm4MoeMTP(MultiTokenPredictor):
    """GLM-4.5's MTP layer as an EAGLE-style head."""

    recycles_normed = False

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Glm4MoeMTPArch:
        """The MTP layer of a GLM-4.5 config; ValueError naming
        ``speculative_config.method`` for a model without one."""
        mtp_head_class(hf_config)  # refuses a model without an MTP layer
        base = MoeArch.from_hf(hf_config)
        sparse = hf_config.num_hidden_layers >= hf_config.first_k_dense_replace  # moe.py's
        per_layer = {
            name: getattr(base, name)[-1:]  # the model's last layer's kind
            for name in ("sliding_windows", "sliding_layers", "rope_layers")
        }
        return MultiTokenPredictor.layer_arch(Glm4MoeMTPArch, base, hf_config, sparse, **per_layer)

    def __init__(self, arch: Glm4MoeMTPArch) -> None:
        mlp = SparseMoeBlock(arch) if arch.sparse_layers else None
        super().__init__(arch, LlamaLayer(arch, mlp))
        self.rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope)

    def init_buffers(self) -> None:
        """The rotary table, in the weights' dtype on their device."""
        a, weight = self.arch, self.eh_proj.weight
        rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope)
        self.rope = rope.to(weight.dtype).to(weight.device)

    def set_attention_backend(self, backend: Any) -> None:
        layer = self.layers[0]
        layer.attn_forward = layer_attention(backend)
        layer.rope_writes_kv = getattr(backend, "writes_kv_with_rotary", False)

    def load_layer(self, sd: dict[str, torch.Tensor]) -> None:
        a, layer = self.arch, self.layers[0]
        load_projections(layer, sd, "", a.attention_bias, a.o_bias, layer.mlp is None)
        if layer.mlp is not None:
            load_moe_block(a, layer.mlp, sd, "")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, norm).weight.copy_(sd[f"{norm}.weight"])
        if a.qk_norm:
            layer.q_norm.weight.copy_(sd["self_attn.q_norm.weight"])
            layer.k_norm.weight.copy_(sd["self_attn.k_norm.weight"])
