"""Multi-token-prediction (MTP) layers as draft heads (vLLM's ``mtp`` method; its older
names, e.g. ``deepseek_mtp``, are taken too).

Some checkpoints carry, after their ``num_hidden_layers`` decoder layers,
``num_nextn_predict_layers`` (1) more: layer ``n`` was trained to predict the token after
next from the main model's hidden state and the next token (DeepSeek-V3/R1, GLM-4.5/4.6).
Served as a draft head it works as an EAGLE-1 head does (``spec_decode/eagle.py``): at
position ``p`` it reads the token at ``p + 1`` and a hidden state for ``p`` (the target's
output, after its final norm, while catching up; its own output while drafting ahead), and
predicts the token at ``p + 2``. Its decoder layer is one of the target family's and caches
like the target's layers, in the target's blocks.

One forward, as the families' own code and vLLM compute it::

    e = enorm(embed(token))          (zero at position 0)
    h = hnorm(hidden)
    x = eh_proj(cat(e, h))           (2H -> H)
    x = layer(x) + its residual      (the family's decoder layer)
    logits = shared_head.head(shared_head.norm(x))

and the hidden state of its next step: ``shared_head.norm(x)`` for DeepSeek (as vLLM
feeds it back), ``x`` itself for GLM (``recycles_normed``).

Checkpoint names, under ``model.layers.{n}.``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm``, optionally ``shared_head.head`` and ``embed_tokens`` (DeepSeek's
files carry copies of the target's; without them the target's are shared, as for GLM),
and the decoder layer's own. Only those tensors are read from the target's files. With
more than one MTP layer every draft comes from the first, as vLLM 0.32's proposer drafts.

Names and semantics follow upstream vLLM's ``deepseek_mtp.py`` and ``glm4_moe_mtp.py``
(facts, not code).
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.llama import RMSNorm
from vllm.v1.attention.backends.abstract import layer_metadata

# model_type -> the head of its MTP layer ("module:Class" under this package).
MTP_HEADS = {
    "deepseek_v3": "deepseek_mtp:DeepseekMTP",
    "glm4_moe": "glm4_moe_mtp:Glm4MoeMTP",
}


def mtp_layer_count(hf_config: Any) -> int:
    """How many MTP layers ``hf_config``'s checkpoint has that a head here reads (0 for a
    family without, or a model whose config says none)."""
    if getattr(hf_config, "model_type", None) not in MTP_HEADS:
        return 0
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def mtp_head_class(hf_config: Any) -> type:
    """The head class of ``hf_config``'s MTP layer; ValueError naming
    ``speculative_config.method`` for a model without one."""
    if not mtp_layer_count(hf_config):
        model_type = getattr(hf_config, "model_type", None)
        layers = getattr(hf_config, "num_nextn_predict_layers", None)
        raise ValueError(
            f"speculative_config.method: mtp drafts with the model's own "
            f"multi-token-prediction layer; {model_type!r} with num_nextn_predict_layers "
            f"{layers} has none (models of type {', '.join(MTP_HEADS)} with "
            f"num_nextn_predict_layers >= 1 do)"
        )
    module, _, name = MTP_HEADS[hf_config.model_type].partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


class SharedHead(nn.Module):
    """The MTP layer's final norm and output head (``shared_head.norm`` / ``.head``)."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class MultiTokenPredictor(nn.Module):
    """An MTP layer as an EAGLE-style head (module docstring). A family's subclass gives
    ``arch_from_hf`` (an arch of one layer with ``mtp_layer``, the layer's index in the
    checkpoint), the decoder layer, its rotary table (``init_buffers``), its attention
    backend and its tensors (``load_layer``)."""

    eagle3 = False
    gguf_layout: ClassVar[Any] = None  # --quantization gguf: refused with its reason
    recycles_normed: ClassVar[bool] = True  # the next step reads shared_head.norm's output

    @staticmethod
    def layer_arch(arch_cls: type, base: Any, hf_config: Any, sparse: bool, **changes: Any):
        """``arch_cls`` (the family's arch with ``mtp_layer``) of the MTP layer: the
        target's ``base`` arch cut to one layer, a mixture of experts when ``sparse``, at
        index ``num_hidden_layers``; ``changes``: more fields."""
        fields = {f: getattr(base, f) for f in type(base).__dataclass_fields__}
        arch = arch_cls(**fields, mtp_layer=hf_config.num_hidden_layers)
        return replace(arch, num_layers=1, sparse_layers=(0,) if sparse else (), **changes)

    @staticmethod
    def checkpoint_prefixes(hf_config: Any) -> tuple[str, ...]:
        """The checkpoint tensors the head reads (the loader skips the target's)."""
        return (f"model.layers.{hf_config.num_hidden_layers}.",)

    def __init__(self, arch: Any, layer: nn.Module) -> None:
        super().__init__()
        self.arch = arch
        h = arch.hidden_size
        self.embed_tokens = nn.Embedding(arch.vocab_size, h)
        self.enorm = RMSNorm(h, arch.rms_norm_eps)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([layer])
        self.shared_head = SharedHead(h, arch.vocab_size, arch.rms_norm_eps)
        self.rope: nn.Module | None = None  # init_buffers
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
        """(num_tokens,) ids and (num_tokens, H) hidden states -> the rows for the logits,
        (num_tokens, H), which are also the next step's hidden states; or, where the next
        step reads the stream before the norm, both as (num_tokens, 2H) (``split``)."""
        embeds = self.embed_tokens(input_ids)
        # Position 0 has no token before it to pair with: the families mask its embedding.
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], dim=-1)
        x = self.eh_proj(x)
        meta = layer_metadata(meta, 1)[0]
        x, residual = self.layers[0](positions, x, None, self.rope, meta, kv_caches[0])
        normed, stream = self.shared_head.norm(x, residual)
        return normed if self.recycles_normed else torch.cat([normed, stream], dim=-1)

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s output -> (rows for the logits, the next step's hidden states)."""
        if self.recycles_normed:
            return out, out
        h = self.arch.hidden_size
        return out[..., :h], out[..., h:]

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
        with torch.no_grad():
            if not self.shares_embed_tokens:
                self.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
            if not self.shares_head:
                self.shared_head.head.weight.copy_(sd["shared_head.head.weight"])
            for name in ("enorm", "hnorm", "eh_proj"):
                getattr(self, name).weight.copy_(sd[f"{name}.weight"])
            self.shared_head.norm.weight.copy_(sd["shared_head.norm.weight"])
            self.load_layer(sd)

    def init_buffers(self) -> None:
        raise NotImplementedError

    def set_attention_backend(self, backend: Any) -> None:
        raise NotImplementedError

    def load_layer(self, sd: dict[str, torch.Tensor]) -> None:
        """Fill ``layers[0]`` from the layer's tensors (named without the prefix)."""
        raise NotImplementedError
