"""DeepSeek-V3's (and GLM-4.7-Flash's) multi-token-prediction layer as a draft head
(``models/mtp.py``): a
DeepSeek-V3 decoder layer (MLA over its own latent cache; the routed and shared experts
where ``first_k_dense_replace`` / ``moe_layer_freq`` make layer ``n`` sparse). Its next
step reads ``shared_head.norm``'s output, as vLLM feeds it back (``DeepSeekMTP`` returns
both states). DeepSeek's files carry copies of the target's embeddings and head under the
layer's prefix; they are loaded when present."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2Arch,
    DeepseekV2Layer,
    deepseek_rope,
    is_sparse_layer,
)
from vllm.model_executor.models.llama import layer_attention
from vllm.model_executor.models.mtp import MultiTokenPredictor, mtp_head_class


@dataclass(frozen=True)
class DeepseekMTPArch(DeepseekV2Arch):
    """The MTP layer's arch: the target's shapes, one layer (``sparse_layers`` (0,) when
    it is a mixture of experts), and its index in the checkpoint."""

    mtp_layer: int = 0


class DeepseekMTP(MultiTokenPredictor):
    """DeepSeek-V3's MTP layer as an EAGLE-style head."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> DeepseekMTPArch:
        """The MTP layer of a DeepSeek-V3 config; ValueError naming
        ``speculative_config.method`` for a model without one."""
        mtp_head_class(hf_config)  # refuses a model without an MTP layer
        base = DeepseekV2Arch.from_hf(hf_config)
        sparse = is_sparse_layer(hf_config, hf_config.num_hidden_layers)
        experts = {}
        if sparse and not base.num_experts:  # every target layer dense, the MTP layer not
            experts = DeepseekV2Arch.experts_from_hf(hf_config, v3=True)
        return MultiTokenPredictor.layer_arch(DeepseekMTPArch, base, hf_config, sparse, **experts)

    def __init__(self, arch: DeepseekMTPArch) -> None:
        super().__init__(arch, DeepseekV2Layer(arch, 0 in arch.sparse_layers))
        self.rope = deepseek_rope(arch)

    def init_buffers(self) -> None:
        """The rotary table, in the weights' dtype on their device."""
        weight = self.eh_proj.weight
        self.rope = deepseek_rope(self.arch).to(weight.dtype).to(weight.device)

    def set_attention_backend(self, backend: Any) -> None:
        """The layer attends with ``backend`` over the latent, as the target's do."""
        self.layers[0].self_attn.attn_forward = layer_attention(backend)

    def load_layer(self, sd: dict[str, torch.Tensor]) -> None:
        layer = self.layers[0]
        layer.self_attn.load(sd, "self_attn.")
        layer.mlp.load(sd, "mlp.")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, norm).weight.copy_(sd[f"{norm}.weight"])


class Glm4MoeLiteMTP(DeepseekMTP):
    """GLM-4.7-Flash's MTP layer: DeepSeek-V3's layer (latent attention, the routed
    experts where ``first_k_dense_replace`` makes layer ``n`` sparse), its next step fed the
    state before ``shared_head.norm``, as GLM-4.5's (vLLM's ``Glm4MoeLiteMTP``)."""

    recycles_normed = False
