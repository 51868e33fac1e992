"""Multi-token-prediction (MTP) layers as draft heads (vLLM's ``mtp`` method; its older
names, e.g. ``deepseek_mtp``, are taken too).

Some checkpoints carry, after their ``num_hidden_layers`` decoder layers, one or more
MTP layers (DeepSeek-V3/R1 and GLM-4.5/4.6: ``num_nextn_predict_layers``; Qwen3-Next and
Qwen3.5: ``mtp.*``, ``models/qwen3_next_mtp.py``): layer ``n`` was trained to predict the
token after next from the main model's hidden state and the next token.
Served as a draft head it works as an EAGLE-1 head does (``spec_decode/eagle.py``): at
position ``p`` it reads the token at ``p + 1`` and a hidden state for ``p`` (the target's
output, after its final norm, while catching up; its own output while drafting ahead), and
predicts the token at ``p + 2``. Its decoder layer is one of the target family's and caches
like the target's layers, in the target's blocks.

One forward, as the families' own code and vLLM compute it::

    e = enorm(embed(token))          (zero at position 0, where ``masks_position_zero``)
    h = hnorm(hidden)
    x = eh_proj(cat(e, h))           (2H -> H)
    x = layer(x) + its residual      (the family's decoder layer)
    logits = shared_head.head(shared_head.norm(x))

and the hidden state of its next step: ``shared_head.norm(x)`` for DeepSeek and Qwen (as
vLLM feeds it back), ``x`` itself for GLM (``recycles_normed``). The norms are the
family's (``norm_cls``: Qwen's scale by ``1 + weight``).

DeepSeek's and GLM's checkpoint names, under ``model.layers.{n}.``: ``enorm``, ``hnorm``,
``eh_proj``, ``shared_head.norm``, optionally ``shared_head.head`` and ``embed_tokens``
(DeepSeek's files carry copies of the target's; without them the target's are shared, as
for GLM), and the decoder layer's own. Only those tensors are read from the target's files. With
more than one MTP layer every draft comes from the first, as vLLM 0.32's proposer drafts.

Names and semantics follow upstream vLLM's ``deepseek_mtp.py`` and ``glm4_moe_mtp.py``
(facts, not code).
"""

from __future__ import annotations

import importlib
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.llama import RMSNorm
from vllm.v1.attention.backends.abstract import layer_metadata

# model_type -> the head of its MTP layer ("module:Class" under this package).
_QWEN_MTP = "qwen3_next_mtp:Qwen3NextMTP"
MTP_HEADS = {
    "deepseek_v3": "deepseek_mtp:DeepseekMTP",
    "glm4_moe": "glm4_moe_mtp:Glm4MoeMTP",
    "glm4_moe_lite": "deepseek_mtp:Glm4MoeLiteMTP",
    "qwen3_next": _QWEN_MTP,
    "qwen3_5_text": _QWEN_MTP,
    "qwen3_5_moe_text": _QWEN_MTP,
    "qwen3_5": _QWEN_MTP,  # the multimodal checkpoints: their text config's layer
    "qwen3_5_moe": _QWEN_MTP,
}
# model_type -> (the text config's field that counts its MTP layers, the count where the
# config has no such field). Qwen3-Next's and Qwen3.5's files carry one layer whether or
# not their config says so (vLLM builds one by default too); a checkpoint without its
# tensors is refused when they are read.
_QWEN_COUNT = ("mtp_num_hidden_layers", 1)
MTP_LAYER_FIELDS = {
    "qwen3_next": ("num_nextn_predict_layers", 1),
    **{t: _QWEN_COUNT for t in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")},
}
_DEFAULT_COUNT = ("num_nextn_predict_layers", 0)


def _count_field(hf_config: Any) -> tuple[str, Any]:
    """(the field counting ``hf_config``'s MTP layers, its value: the default where the
    config has none), read from the text config of a multimodal one."""
    field, default = MTP_LAYER_FIELDS.get(getattr(hf_config, "model_type", None), _DEFAULT_COUNT)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return field, getattr(text, field, default)


def mtp_layer_count(hf_config: Any) -> int:
    """How many MTP layers ``hf_config``'s checkpoint has that a head here reads (0 for a
    family without, or a model whose config says none)."""
    if getattr(hf_config, "model_type", None) not in MTP_HEADS:
        return 0
    return int(_count_field(hf_config)[1] or 0)


def mtp_head_class(hf_config: Any) -> type:
    """The head class of ``hf_config``'s MTP layer; ValueError naming
    ``speculative_config.method`` for a model without one."""
    if not mtp_layer_count(hf_config):
        model_type = getattr(hf_config, "model_type", None)
        if model_type in MTP_HEADS:
            field, layers = _count_field(hf_config)
            why = f"{model_type!r} with {field} {layers} has none"
        else:
            why = f"{model_type!r} has none that is served here"
        raise ValueError(
            f"speculative_config.method: mtp drafts with the model's own "
            f"multi-token-prediction layer; {why} (models of type {', '.join(MTP_HEADS)} "
            f"whose config counts at least one do)"
        )
    module, _, name = MTP_HEADS[hf_config.model_type].partition(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


class SharedHead(nn.Module):
    """The MTP layer's final norm and output head (``shared_head.norm`` / ``.head``; no
    head of its own where ``head`` is False: the target's is shared)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        eps: float,
        norm_cls: type = RMSNorm,
        head: bool = True,
    ) -> None:
        super().__init__()
        self.norm = norm_cls(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False) if head else None


class MultiTokenPredictor(nn.Module):
    """An MTP layer as an EAGLE-style head (module docstring). A family's subclass gives
    ``arch_from_hf`` (an arch of one layer with ``mtp_layer``, the layer's index in the
    checkpoint), the decoder layer, its rotary table (``init_buffers``), its attention
    backend and its tensors (``load_layer``, or all of ``load_weights``)."""

    eagle3 = False
    gguf_layout: ClassVar[Any] = None  # --quantization gguf: refused with its reason
    recycles_normed: ClassVar[bool] = True  # the next step reads shared_head.norm's output
    masks_position_zero: ClassVar[bool] = True  # the embedding at position 0 reads as zero
    norm_cls: ClassVar[type] = RMSNorm  # enorm's, hnorm's and shared_head.norm's class
    # Whether the checkpoint may carry copies of the embeddings and the output head (False:
    # the target's are always shared, and the head makes none to be replaced).
    may_own_copies: ClassVar[bool] = True
    # Whether its layers keep recurrent states (none here does): a head that did could not
    # draft for a model with recurrent layers (layers/recurrent.py refuses it).
    recurrent_layers: ClassVar[bool] = False

    @staticmethod
    def layer_arch(arch_cls: type, base: Any, hf_config: Any, sparse: bool, **changes: Any):
        """``arch_cls`` (the family's arch with ``mtp_layer``) of the MTP layer: the
        target's ``base`` arch cut to one layer, a mixture of experts when ``sparse``, at
        index ``num_hidden_layers``; ``changes``: more fields."""
        fields = {f.name: getattr(base, f.name) for f in dataclass_fields(base)}
        arch = arch_cls(**fields, mtp_layer=hf_config.num_hidden_layers)
        return replace(arch, num_layers=1, sparse_layers=(0,) if sparse else (), **changes)

    @staticmethod
    def checkpoint_prefixes(hf_config: Any) -> tuple[str, ...]:
        """The checkpoint tensors the head reads (the loader skips the target's)."""
        return (f"model.layers.{hf_config.num_hidden_layers}.",)

    def __init__(self, arch: Any, layer: nn.Module) -> None:
        super().__init__()
        self.arch = arch
        h, eps, copies = arch.hidden_size, arch.rms_norm_eps, self.may_own_copies
        self.embed_tokens = nn.Embedding(arch.vocab_size, h) if copies else None
        self.enorm = self.norm_cls(h, eps)
        self.hnorm = self.norm_cls(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([layer])
        self.shared_head = SharedHead(h, arch.vocab_size, eps, self.norm_cls, head=copies)
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
        if self.masks_position_zero:
            # Position 0 has no token before it to pair with: DeepSeek and GLM mask it.
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
