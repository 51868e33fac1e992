"""DeepSeek-V3's multi-token prediction (MTP) layer as a draft head (vLLM's ``mtp``
method; ``deepseek_mtp`` is its old name).

DeepSeek-V3/R1 checkpoints carry, after their ``num_hidden_layers`` decoder layers,
``num_nextn_predict_layers`` (1) more: layer ``n`` was trained to predict the token after
next from the main model's hidden state and the next token. Served as a draft head it
works as an EAGLE-1 head does (``spec_decode/eagle.py``): at position ``p`` it reads the
token at ``p + 1`` and a hidden state for ``p`` (the target's output, after its final norm,
while catching up; its own output while drafting ahead), and predicts the token at
``p + 2``. Its layer caches the MLA latent like the target's layers, in the target's
blocks.

One forward, as DeepSeek's and vLLM's code compute it::

    e = enorm(embed(token))          (zero at position 0)
    h = hnorm(hidden)
    x = eh_proj(cat(e, h))           (2H -> H)
    x = layer(x) + its residual      (a DeepSeek-V3 decoder layer: MLA, experts)
    out = shared_head.norm(x)        the next step's hidden state and, through
    logits = shared_head.head(out)   shared_head.head, the draft's logits

Checkpoint names, under ``model.layers.{n}.``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, ``shared_head.head`` and ``embed_tokens`` (copies of the target's in
the released checkpoints; without them the target's are shared) and the decoder layer's own
(``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``post_attention_layernorm``). Only those
tensors are read from the target's files. With more than one MTP layer every draft comes
from the first, as vLLM 0.32's proposer drafts.

Names and semantics follow upstream vLLM's ``deepseek_mtp.py`` (facts, not code).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2Arch,
    DeepseekV2Layer,
    deepseek_rope,
    is_sparse_layer,
)
from vllm.model_executor.models.llama import RMSNorm, layer_attention
from vllm.v1.attention.backends.abstract import layer_metadata

# The model types whose checkpoints carry MTP layers that this head reads.
MTP_MODEL_TYPES = ("deepseek_v3",)


@dataclass(frozen=True)
class DeepseekMTPArch(DeepseekV2Arch):
    """The MTP layer's arch: the target's shapes, one layer (``sparse_layers`` (0,) when
    it is a mixture of experts), and its index in the checkpoint."""

    mtp_layer: int = 0


def mtp_layer_count(hf_config: Any) -> int:
    """How many MTP layers ``hf_config``'s checkpoint has (0 for a model without)."""
    if getattr(hf_config, "model_type", None) not in MTP_MODEL_TYPES:
        return 0
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


class SharedHead(nn.Module):
    """The MTP layer's final norm and output head (``shared_head.norm`` / ``.head``)."""

    def __init__(self, a: DeepseekV2Arch) -> None:
        super().__init__()
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)


class DeepseekMTP(nn.Module):
    """DeepSeek-V3's MTP layer as an EAGLE-style head (module docstring)."""

    eagle3 = False
    gguf_layout: ClassVar[Any] = None  # --quantization gguf: refused with its reason

    @staticmethod
    def arch_from_hf(hf_config: Any) -> DeepseekMTPArch:
        """The MTP layer of a DeepSeek-V3 config; ValueError naming
        ``speculative_config.method`` for a model without one."""
        if not mtp_layer_count(hf_config):
            raise ValueError(
                f"speculative_config.method: mtp drafts with the model's own "
                f"multi-token-prediction layer; {getattr(hf_config, 'model_type', None)!r} "
                f"with num_nextn_predict_layers "
                f"{getattr(hf_config, 'num_nextn_predict_layers', None)} has none (models "
                f"of type {', '.join(MTP_MODEL_TYPES)} with num_nextn_predict_layers >= 1 do)"
            )
        base = DeepseekV2Arch.from_hf(hf_config)
        n = hf_config.num_hidden_layers
        sparse = is_sparse_layer(hf_config, n)
        experts = {}
        if sparse and not base.num_experts:  # every target layer dense, the MTP layer not
            experts = DeepseekV2Arch.experts_from_hf(hf_config, v3=True)
        fields = {f: getattr(base, f) for f in DeepseekV2Arch.__dataclass_fields__}
        arch = DeepseekMTPArch(**fields, mtp_layer=n)
        return replace(arch, num_layers=1, sparse_layers=(0,) if sparse else (), **experts)

    @staticmethod
    def checkpoint_prefixes(hf_config: Any) -> tuple[str, ...]:
        """The checkpoint tensors the head reads (the loader skips the target's)."""
        return (f"model.layers.{hf_config.num_hidden_layers}.",)

    def __init__(self, arch: DeepseekMTPArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.enorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.hnorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * arch.hidden_size, arch.hidden_size, bias=False)
        self.layers = nn.ModuleList([DeepseekV2Layer(arch, 0 in arch.sparse_layers)])
        self.shared_head = SharedHead(arch)
        self.rope = deepseek_rope(arch)
        # Until a checkpoint brings its own, the target's (share_target_weights).
        self.shares_embed_tokens = True
        self.shares_head = True

    @property
    def attention_features(self) -> frozenset[str]:
        return frozenset()

    @property
    def target_hidden_width(self) -> int:
        """The width of the target's hidden states the head reads (a row's)."""
        return self.arch.hidden_size

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the hidden states the head reads."""
        return self.eh_proj.weight.dtype

    def set_attention_backend(self, backend: Any) -> None:
        """The layer attends with ``backend`` over the latent, as the target's do."""
        self.layers[0].self_attn.attn_forward = layer_attention(backend)

    def init_buffers(self) -> None:
        """The rotary table, in the weights' dtype on their device."""
        weight = self.eh_proj.weight
        self.rope = deepseek_rope(self.arch).to(weight.dtype).to(weight.device)

    def share_target_weights(self, target: nn.Module) -> None:
        """The target's ``embed_tokens`` and ``lm_head`` where the checkpoint has no copy."""
        if self.shares_embed_tokens:
            self.embed_tokens = target.embed_tokens
        if self.shares_head:
            self.shared_head.head = target.lm_head

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the head's input: as they are."""
        return hidden

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, meta: Any, kv_caches, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """(num_tokens,) ids and (num_tokens, H) hidden states -> (num_tokens, H): the
        rows for the logits, which are also the next step's hidden states."""
        embeds = self.embed_tokens(input_ids)
        # Position 0 has no token before it to pair with: DeepSeek masks its embedding.
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], dim=-1)
        x = self.eh_proj(x)
        meta = layer_metadata(meta, 1)[0]
        x, residual = self.layers[0](positions, x, None, self.rope, meta, kv_caches[0])
        return self.shared_head.norm(x, residual)[0]

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s output -> (rows for the logits, the next step's hidden states):
        the same tensor."""
        return out, out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(hidden).float()

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The MTP layer's tensors (``model.layers.{n}.``); its embeddings and head when
        the checkpoint has them (else the target's are shared later)."""
        prefix = f"model.layers.{self.arch.mtp_layer}."
        sd = {k.removeprefix(prefix): v for k, v in sd.items() if k.startswith(prefix)}
        if "eh_proj.weight" not in sd:
            raise ValueError(
                f"speculative_config.model: the checkpoint has no multi-token-prediction "
                f"layer ({prefix}eh_proj.weight and the rest are missing)"
            )
        self.init_buffers()
        self.shares_embed_tokens = "embed_tokens.weight" not in sd
        self.shares_head = "shared_head.head.weight" not in sd
        layer = self.layers[0]
        with torch.no_grad():
            if not self.shares_embed_tokens:
                self.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
            if not self.shares_head:
                self.shared_head.head.weight.copy_(sd["shared_head.head.weight"])
            for name in ("enorm", "hnorm", "eh_proj"):
                getattr(self, name).weight.copy_(sd[f"{name}.weight"])
            self.shared_head.norm.weight.copy_(sd["shared_head.norm.weight"])
            layer.self_attn.load(sd, "self_attn.")
            layer.mlp.load(sd, "mlp.")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, norm).weight.copy_(sd[f"{norm}.weight"])
