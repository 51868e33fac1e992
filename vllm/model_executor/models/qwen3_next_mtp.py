"""Qwen3-Next's and Qwen3.5's multi-token-prediction layer as a draft head
(``models/mtp.py``): one gated full-attention decoder layer of the target's family
(``models/qwen3_next.py``: q/k norms, the sigmoid output gate, the partial rotation) with
the family's feed-forward (Qwen3.5's dense MLP; Qwen3.5-MoE's experts; Qwen3-Next's where
its ``mlp_only_layers`` / ``decoder_sparse_step`` rule makes layer 0 sparse, as vLLM
builds the layer under the name ``mtp.layers.0``). It has no linear-attention layer, so
it keeps no recurrent states: it drafts for these hybrid models as an EAGLE head does,
and the target's states are rolled back to the drafts it keeps (``layers/recurrent.py``).

Checkpoint names (the same in the text-only and the multimodal files, beside
``model.*`` / ``model.language_model.*``), as ``mtp.py``'s roles::

    mtp.pre_fc_norm_embedding   enorm            (zero-centred: 1 + weight, as every
    mtp.pre_fc_norm_hidden      hnorm             norm here)
    mtp.fc                      eh_proj          cat(embedding, hidden) -> H
    mtp.layers.0.*              the decoder layer
    mtp.norm                    shared_head.norm

The embeddings and the output head are the target's (the files hold no copies). Unlike
DeepSeek's and GLM's, the embedding at position 0 is not masked; the next step reads the
normed output (vLLM's ``Qwen3NextMTP`` / ``Qwen3_5MTP``: facts, not code). The count of
layers: Qwen3-Next's ``num_nextn_predict_layers``, Qwen3.5's ``mtp_num_hidden_layers``
(the text config's), one where the config names none.

Not here: images for the multimodal checkpoints' head. It rotates by the token's index
(M-RoPE's position for every token of a text-only prompt, not after an image) and embeds
an image's ``<|image_pad|>`` tokens as tokens, not the tower's rows, so around an image
its drafts may be worse, never wrong: the target verifies them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from vllm.model_executor.models.gemma import GemmaRMSNorm
from vllm.model_executor.models.llama import RotaryEmbedding
from vllm.model_executor.models.moe import SparseMoeBlock, load_moe_block
from vllm.model_executor.models.mtp import MultiTokenPredictor, mtp_head_class
from vllm.model_executor.models.qwen3_next import FULL, DecoderLayer, Qwen3NextArch

PREFIX = "mtp."
# The checkpoint's names (under ``mtp.``) of the roles mtp.py's head gives them.
ROLES = {
    "pre_fc_norm_embedding.weight": "enorm.weight",
    "pre_fc_norm_hidden.weight": "hnorm.weight",
    "fc.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}


@dataclass(frozen=True)
class Qwen3NextMTPArch(Qwen3NextArch):
    """The MTP layer's arch: a one-layer model of full attention with the target's shapes,
    and the layer's index under ``mtp.layers``."""

    mtp_layer: int = 0


class ZeroCentredRMSNorm(GemmaRMSNorm):
    """``GemmaRMSNorm`` (``1 + weight``) that also takes the residual stream, as mtp.py's
    head calls its final norm: ``(norm(x + residual), x + residual)``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return super().forward(x)
        stream = x + residual
        return super().forward(stream), stream


class MTPDecoderLayer(DecoderLayer):
    """The family's full-attention decoder layer in vLLM's calling convention: (positions,
    x, residual, rope, meta, kv_cache) -> (the MLP's output, the stream before it)."""

    def forward(self, positions, x, residual, rope, meta: Any, kv_cache):
        if residual is not None:
            x = x + residual
        x = x + self.self_attn(positions, self.input_layernorm(x), rope, meta, kv_cache)
        return self.mlp(self.post_attention_layernorm(x)), x


class Qwen3NextMTP(MultiTokenPredictor):
    """Qwen3-Next's / Qwen3.5's MTP layer as an EAGLE-style head (module docstring)."""

    masks_position_zero = False
    norm_cls = ZeroCentredRMSNorm
    may_own_copies = False

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Qwen3NextMTPArch:
        """The MTP layer of a Qwen3-Next or Qwen3.5 config (the text config of a
        multimodal one); ValueError naming ``speculative_config.method`` for a model
        without one."""
        mtp_head_class(hf_config)  # refuses a model without an MTP layer
        text = hf_config.get_text_config()
        one = copy.deepcopy(text)  # a model of the one layer: its experts by index 0's rule
        one.num_hidden_layers, one.layer_types = 1, [FULL]
        base = Qwen3NextArch.from_hf(one)
        sparse = bool(base.sparse_layers)
        return MultiTokenPredictor.layer_arch(Qwen3NextMTPArch, base, one, sparse, mtp_layer=0)

    @staticmethod
    def checkpoint_prefixes(hf_config: Any) -> tuple[str, ...]:
        return (PREFIX,)

    def __init__(self, arch: Qwen3NextMTPArch) -> None:
        super().__init__(arch, MTPDecoderLayer(arch, 0))
        self.rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope)

    def init_buffers(self) -> None:
        """The rotary table, in the weights' dtype on their device."""
        a, weight = self.arch, self.eh_proj.weight
        rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope)
        self.rope = rope.to(weight.dtype).to(weight.device)

    def set_attention_backend(self, backend: Any) -> None:
        self.layers[0].self_attn.attn_forward = backend.forward

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The layer's tensors (``mtp.*``, module docstring); ValueError naming
        ``speculative_config.model`` for a checkpoint without them."""
        p = f"{PREFIX}layers.{self.arch.mtp_layer}."
        missing = [PREFIX + k for k in ROLES if PREFIX + k not in sd]
        if missing or not any(k.startswith(p) for k in sd):
            raise ValueError(
                f"speculative_config.model: the checkpoint has no multi-token-prediction "
                f"layer ({', '.join(missing) or p + '*'} missing)"
            )
        self.init_buffers()
        with torch.no_grad():
            for name, role in ROLES.items():
                self.get_parameter(role).copy_(sd[PREFIX + name])
            try:
                self.load_layer({k.removeprefix(p): v for k, v in sd.items() if k.startswith(p)})
            except KeyError as e:
                raise ValueError(
                    f"speculative_config.model: the checkpoint's multi-token-prediction "
                    f"layer has no tensor {p}{e.args[0]}"
                ) from None

    def load_layer(self, sd: dict[str, torch.Tensor]) -> None:
        """``layers[0]`` from its tensors, named as the target's layers' without the
        ``layers.N.`` prefix."""
        layer = self.layers[0]
        layer.self_attn.load(sd, "self_attn.")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, norm).weight.copy_(sd[f"{norm}.weight"])
        if isinstance(layer.mlp, SparseMoeBlock):
            load_moe_block(self.arch, layer.mlp, sd, "")
        else:
            gate_up = [sd[f"mlp.{n}_proj.weight"] for n in ("gate", "up")]
            layer.mlp.gate_up_proj.weight.copy_(torch.cat(gate_up))
            layer.mlp.down_proj.weight.copy_(sd["mlp.down_proj.weight"])
