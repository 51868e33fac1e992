"""EAGLE heads over a Llama-family target (vLLM's ``eagle`` and ``eagle3`` methods).

An EAGLE head is a one-layer (or few-layer) Llama decoder that drafts from the target's
own hidden states instead of from tokens alone. At position ``p`` it reads the token at
``p + 1`` and a hidden state for ``p``: the target's (while catching up on what the target
computed) or its own output at ``p - 1`` (while drafting ahead), and predicts the token at
``p + 2``. Its layers cache K/V like any model's (``spec_decode/eagle.py`` keeps them in
the target's blocks).

- **EAGLE-1** (``EagleLlamaForCausalLM``): ``fc`` maps ``cat(embed(token), hidden)``
  (2H) to H; layer 0 has no input norm; the output ``x + residual`` is both the next
  step's hidden state and, through the *target's* ``lm_head``, the logits. The hidden
  state it is trained on is the target's last one (after the final norm), as vLLM feeds
  it. Checkpoint names: ``fc.weight``, ``layers.N.*`` (no ``layers.0.input_layernorm``),
  optionally ``embed_tokens.weight``.
- **EAGLE-3** (``Eagle3LlamaForCausalLM``): the target exposes three (``eagle_aux_hidden
  _state_layer_ids``, default ``(2, n // 2, n - 3)``) residual-stream states, the stream
  after that many target layers; ``fc`` maps their concatenation (3H) to H once, when
  they enter (``combine_hidden_states``). Layer 0's q/k/v read ``cat(input_layernorm(
  embed(token)), hidden_norm(hidden))`` (2H), its residual the hidden state (or its norm:
  ``norm_before_residual``); a final ``norm``; its own ``lm_head`` over a draft
  vocabulary, mapped to the target's ids by ``d2t`` (draft id ``i`` is target id ``i +
  d2t[i]``; the other ids get -inf). The next step's hidden state is the stream before the
  final norm (after it with ``norm_output``). Checkpoint names: ``midlayer.*`` (or
  ``layers.0.*``), ``fc.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (``t2d``
  unused), optionally ``embed_tokens.weight``, ``input_norm.weight`` (``norm_before_fc``)
  and ``fc_norm.N.weight`` (``fc_norm``).

A head without ``embed_tokens`` shares the target's (``share_target_weights``), as vLLM
does; EAGLE-1 always uses the target's ``lm_head``. ``forward`` returns the rows for the
logits and the next step's hidden states as one tensor, so that a CUDA graph's output
buffer holds both: ``(num_tokens, H)`` where they are the same (EAGLE-1; EAGLE-3 with
``norm_output``), else ``(num_tokens, 2H)``, the logits' rows first (``split``).

The layout and names follow upstream vLLM's ``llama_eagle.py`` / ``llama_eagle3.py`` and
the EAGLE checkpoints they load (facts, not code).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.model_executor.models.llama import (
    LlamaArch,
    LlamaForCausalLM,
    LlamaLayer,
    RMSNorm,
    load_projections,
)
from vllm.v1.attention.backends.abstract import layer_metadata


def eagle_config_value(hf_config: Any, key: str, default: Any = None) -> Any:
    """``key`` from an EAGLE head's config: its own attribute, else its ``eagle_config``
    dict (the speculators format), else ``default``."""
    value = getattr(hf_config, key, None)
    if value is not None:
        return value
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    return eagle_config.get(key, default) if isinstance(eagle_config, dict) else default


def eagle3_aux_layers(hf_config: Any, num_target_layers: int) -> tuple[int, ...]:
    """The target layer boundaries whose residual stream an EAGLE-3 head reads (``L``: the
    stream after ``L`` layers; 0 is the embedding), ascending and once each, as the target
    appends them while it runs: the head's ``eagle_aux_hidden_state_layer_ids``, else
    ``(2, n // 2, n - 3)``. ValueError for an id outside ``[0, n]``."""
    ids = eagle_config_value(hf_config, "eagle_aux_hidden_state_layer_ids")
    if not ids:
        n = num_target_layers
        ids = (2, n // 2, n - 3)
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= num_target_layers:
            raise ValueError(
                f"speculative_config.model: eagle_aux_hidden_state_layer_ids {list(ids)} "
                f"must name layer boundaries in [0, {num_target_layers}] of the target"
            )
    return tuple(sorted(set(ids)))


class EagleLlamaForCausalLM(LlamaForCausalLM):
    """EAGLE-1 over a Llama-family target (module docstring)."""

    eagle3 = False

    @staticmethod
    def arch_from_hf(hf_config: Any) -> LlamaArch:
        return LlamaArch.from_hf(hf_config)

    def __init__(self, arch: LlamaArch) -> None:
        super().__init__(arch)
        self.lm_head = None  # the target's (share_target_weights)
        self.norm = None  # EAGLE-1 has no final norm
        self.fc = nn.Linear(2 * arch.hidden_size, arch.hidden_size, bias=False)
        self.layers[0].input_layernorm = nn.Identity()
        self.shares_embed_tokens = True  # until a checkpoint brings its own
        self.logits_scaling = 1.0

    @property
    def attention_features(self) -> frozenset[str]:
        return frozenset()

    def init_buffers(self) -> None:
        """The rotary table (no tied head: the head is the target's)."""
        a, weight = self.arch, self.fc.weight
        rope = type(self.rope)(a.head_dim, a.max_position_embeddings, a.rope)
        self.rope = rope.to(weight.dtype).to(weight.device)

    def share_target_weights(self, target: nn.Module) -> None:
        """The target's ``lm_head`` (and its logits scaling) and, when the checkpoint has
        none, its ``embed_tokens``."""
        self.lm_head = target.lm_head
        self.logits_scaling = getattr(target.arch, "logits_scaling", 1.0)
        if self.shares_embed_tokens:
            self.embed_tokens = target.embed_tokens

    @property
    def target_hidden_width(self) -> int:
        """The width of the target's hidden states the head reads (a row's)."""
        return self.arch.hidden_size

    @property
    def hidden_dtype(self) -> torch.dtype:
        """The dtype of the hidden states the head reads."""
        return self.fc.weight.dtype

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the head's input (EAGLE-1: as they are)."""
        return hidden

    def _layers(self, x, residual, positions, meta, kv_caches):
        metas = layer_metadata(meta, len(self.layers))
        for layer, kv_cache, m in zip(self.layers, kv_caches, metas, strict=True):
            x, residual = layer(positions, x, residual, self.rope, m, kv_cache)
        return x, residual

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, meta: Any, kv_caches, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """(num_tokens,) ids and (num_tokens, H) hidden states -> (num_tokens, H): the
        rows for the logits, which are also the next step's hidden states."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden_states], dim=-1))
        x, residual = self._layers(x, None, positions, meta, kv_caches)
        return x + residual

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s output -> (rows for the logits, the next step's hidden states):
        one tensor twice when it is H wide, else its two halves."""
        h = self.arch.hidden_size
        if out.shape[-1] == h:
            return out, out
        return out[..., :h], out[..., h:]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The checkpoint's tensors (EAGLE-3's ``midlayer.`` read as ``layers.0.``); its
        ``embed_tokens`` when it has them (else the target's are shared later)."""
        sd = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v for k, v in sd.items()}
        self.init_buffers()
        self.shares_embed_tokens = "embed_tokens.weight" not in sd
        with torch.no_grad():
            if not self.shares_embed_tokens:
                self.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
            self.fc.weight.copy_(sd["fc.weight"])
            self._load_layers(sd)
            self._load_own(sd)

    def _load_own(self, sd: dict[str, torch.Tensor]) -> None:
        """What a head has beyond embeddings, ``fc`` and its layers (EAGLE-1: nothing)."""

    def _load_layers(self, sd: dict[str, torch.Tensor]) -> None:
        a = self.arch
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            load_projections(layer, sd, p, a.attention_bias, a.o_bias)
            layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
            if a.qk_norm:  # a Qwen3 layer's (speculators' Qwen3 heads)
                layer.q_norm.weight.copy_(sd[p + "self_attn.q_norm.weight"])
                layer.k_norm.weight.copy_(sd[p + "self_attn.k_norm.weight"])
            if isinstance(layer.input_layernorm, RMSNorm):
                layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])


@dataclass(frozen=True)
class Eagle3Arch(LlamaArch):
    """An EAGLE-3 head's Llama arch and its own options (module docstring)."""

    draft_vocab_size: int = 0
    target_hidden_size: int = 0
    num_aux: int = 3
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False


class Eagle3Layer(LlamaLayer):
    """EAGLE-3's first layer: q/k/v over ``cat(input_layernorm(embeds), hidden_norm(
    hidden))``, the residual stream starting from the hidden state (or its norm)."""

    def __init__(self, a: Eagle3Arch) -> None:
        super().__init__(a)
        self.qkv_proj = nn.Linear(
            2 * a.hidden_size, self.q_size + 2 * self.kv_size, bias=a.attention_bias
        )
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward_eagle3(
        self, positions, embeds, hidden, rope, meta, kv_cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual), as ``LlamaLayer.forward``, from the token embeddings and the
        hidden states."""
        embeds = self.input_layernorm(embeds)
        normed = self.hidden_norm(hidden)
        # A new tensor either way: the fused norm below adds into it in place.
        residual = normed.clone() if self.a.norm_before_residual else hidden.clone()
        h = torch.cat([embeds, normed], dim=-1)
        out = self._attention(positions, h, rope, meta, kv_cache)
        h, residual = self.post_attention_layernorm(out, residual)
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h))), residual


class Eagle3LlamaForCausalLM(EagleLlamaForCausalLM):
    """EAGLE-3 over a Llama-family target (module docstring)."""

    eagle3 = True

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Eagle3Arch:
        base = LlamaArch.from_hf(hf_config)
        aux_ids = eagle_config_value(hf_config, "eagle_aux_hidden_state_layer_ids")
        num_aux = getattr(hf_config, "num_aux_hidden_states", None)
        if eagle_config_value(hf_config, "use_aux_hidden_state", True) is False:
            raise ValueError(
                "speculative_config.model: an EAGLE-3 head without auxiliary hidden states "
                "(use_aux_hidden_state false) is not supported"
            )
        return Eagle3Arch(
            **{f.name: getattr(base, f.name) for f in fields(LlamaArch)},
            draft_vocab_size=getattr(hf_config, "draft_vocab_size", None) or base.vocab_size,
            target_hidden_size=(getattr(hf_config, "target_hidden_size", None) or base.hidden_size),
            num_aux=num_aux or (len(aux_ids) if aux_ids else 3),
            norm_before_residual=bool(getattr(hf_config, "norm_before_residual", False)),
            norm_before_fc=bool(eagle_config_value(hf_config, "norm_before_fc", False)),
            fc_norm=bool(getattr(hf_config, "fc_norm", False)),
            norm_output=bool(getattr(hf_config, "norm_output", False)),
        )

    def __init__(self, arch: Eagle3Arch) -> None:
        super().__init__(arch)
        self.layers[0] = Eagle3Layer(arch)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.draft_vocab_size, bias=False)
        fc_in = arch.num_aux * arch.target_hidden_size
        self.fc = nn.Linear(fc_in, arch.hidden_size, bias=False)
        self.input_norm = RMSNorm(fc_in, arch.rms_norm_eps) if arch.norm_before_fc else None
        self.fc_norm = None
        if arch.fc_norm:
            self.fc_norm = nn.ModuleList(
                RMSNorm(arch.target_hidden_size, arch.rms_norm_eps) for _ in range(arch.num_aux)
            )
        # Draft id i is target id draft_to_target[i] (i + the checkpoint's d2t[i]); None:
        # the target's vocabulary.
        ids = (
            torch.arange(arch.draft_vocab_size)
            if arch.draft_vocab_size != arch.vocab_size
            else None
        )
        self.register_buffer("draft_to_target", ids, persistent=False)

    def init_buffers(self) -> None:
        """The rotary table, and the identity map of draft ids (the checkpoint's ``d2t``
        replaces it; random weights keep it)."""
        super().init_buffers()
        if self.draft_to_target is not None:
            with torch.no_grad():
                self.draft_to_target.copy_(torch.arange(self.arch.draft_vocab_size))

    def share_target_weights(self, target: nn.Module) -> None:
        """The target's ``embed_tokens`` when the checkpoint has none (its own head)."""
        if self.shares_embed_tokens:
            self.embed_tokens = target.embed_tokens

    @property
    def target_hidden_width(self) -> int:
        return self.arch.num_aux * self.arch.target_hidden_size

    def combine_hidden_states(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary hidden states (num_tokens, num_aux * H) -> the head's
        input (num_tokens, H): optional norms, then ``fc``."""
        if self.input_norm is not None:
            hidden = self.input_norm(hidden)
        if self.fc_norm is not None:
            chunks = hidden.chunk(len(self.fc_norm), dim=-1)
            hidden = torch.cat(
                [norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1
            )
        return self.fc(hidden)

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, meta: Any, kv_caches, hidden_states: torch.Tensor
    ) -> torch.Tensor:
        metas = layer_metadata(meta, len(self.layers))
        embeds = self.embed_tokens(input_ids)
        x, residual = self.layers[0].forward_eagle3(
            positions, embeds, hidden_states, self.rope, metas[0], kv_caches[0]
        )
        for layer, kv_cache, m in zip(self.layers[1:], kv_caches[1:], metas[1:], strict=True):
            x, residual = layer(positions, x, residual, self.rope, m, kv_cache)
        normed, stream = self.norm(x, residual)
        return normed if self.arch.norm_output else torch.cat([normed, stream], dim=-1)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft vocabulary's logits placed at their target ids (-inf elsewhere)."""
        logits = self.lm_head(hidden).float()
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.arch.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_to_target, logits)

    def _load_own(self, sd: dict[str, torch.Tensor]) -> None:
        """The final norm, the head, the optional norms of ``fc``'s input, layer 0's
        ``hidden_norm`` and the draft vocabulary's map."""
        self.norm.weight.copy_(sd["norm.weight"])
        self.lm_head.weight.copy_(sd["lm_head.weight"])
        if self.input_norm is not None:
            self.input_norm.weight.copy_(sd["input_norm.weight"])
        for i, norm in enumerate(self.fc_norm or ()):
            norm.weight.copy_(sd[f"fc_norm.{i}.weight"])
        self.layers[0].hidden_norm.weight.copy_(sd["layers.0.hidden_norm.weight"])
        if self.draft_to_target is not None:
            if "d2t" not in sd:
                raise ValueError(
                    "speculative_config.model: an EAGLE-3 head with draft_vocab_size "
                    f"{self.arch.draft_vocab_size} < vocab_size {self.arch.vocab_size} "
                    "needs its d2t tensor"
                )
            ids = torch.arange(self.arch.draft_vocab_size) + sd["d2t"].long().cpu()
            self.draft_to_target.copy_(ids)
