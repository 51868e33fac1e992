"""Liquid AI's LFM2 (``Lfm2ForCausalLM``: LFM2-350M, -700M, -1.2B, -2.6B) and LFM2-MoE
(``Lfm2MoeForCausalLM``: LFM2-8B-A1B), as transformers computes them: hybrids whose layers
(``layer_types``) are gated short convolutions ("conv") or grouped-query attention
("full_attention"), each a pre-norm mixer (``operator_norm``) and a pre-norm feed-forward
(``ffn_norm``), both summed into the residual stream. The final norm is the checkpoint's
``embedding_norm``; the output head is tied to the embeddings (``tie_embedding``).

- **Short convolution** (``ShortConv``): ``in_proj`` gives B, C and x (hidden each, in
  that order); ``B * x`` through a depthwise causal convolution of width ``conv_L_cache``
  (plus a bias under ``conv_bias``, which biases the projections too; no activation),
  times C, through ``out_proj``. Its state per sequence, the convolution's last
  ``conv_L_cache - 1`` inputs, lives in the recurrent pools (``layers/recurrent.py``) as
  Qwen3-Next's and the Mamba2 hybrids' states do; a step's decodes are one batched update
  (``RecurrentStep``), its prefill chunks one sequence at a time.
- **Attention**: q and k RMS-normalised per head (``q_layernorm``, ``k_layernorm``), then
  rotated (every dimension of a head), K/V in the paged cache; ``out_proj``.
- **Feed-forward**: the SiLU-gated MLP ``w2(silu(w1 x) * w3 x)``. LFM2 derives its width
  from ``intermediate_size`` under ``block_auto_adjust_ff_dim``: two thirds of it, times
  ``block_ffn_dim_multiplier`` and rounded up to ``block_multiple_of`` (unless the
  multiplier is None). LFM2-MoE's first ``num_dense_layers`` keep the MLP (its
  ``intermediate_size`` as given); the others route each token to experts: sigmoid
  scores, the top k chosen by score plus ``expert_bias`` (``use_expert_bias``), weighted
  by their plain scores divided by their sum plus 1e-6 (``norm_topk_prob``), times
  ``routed_scaling_factor``.

The arch's ``num_layers`` and head counts are the attention layers' (the KV cache has a
tensor per attention layer); ``layer_types`` holds every layer's kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts_grouped
from vllm.model_executor.layers.gated_delta_net import causal_conv1d, causal_conv1d_step
from vllm.model_executor.layers.recurrent import RecurrentStep, StateSpec
from vllm.model_executor.layers.rotary_embedding import max_positions, rope_parameters
from vllm.model_executor.models.hybrid_base import CheckpointTensors, HybridCausalLM, StepMixers
from vllm.model_executor.models.llama import (
    RMSNorm,
    RotaryEmbedding,
    _no_attention_backend,
    init_projections,
)
from vllm.model_executor.models.moe import stacked_experts
from vllm.model_executor.models.qwen3_next import DenseMLP

CONV, ATTENTION = "conv", "full_attention"
ROUTING_EPS = 1e-6  # transformers' Lfm2MoeTopKRouter renormalises over sum + 1e-6


@dataclass(frozen=True)
class Lfm2Arch:
    hidden_size: int
    num_layers: int  # the attention layers: the KV cache's
    num_heads: int  # the attention layers' shapes
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int  # the rotary table's length
    tie_word_embeddings: bool
    rope: dict[str, Any]  # rotary_embedding.rope_parameters' dict
    layer_types: tuple[str, ...]  # every layer's kind: CONV or ATTENTION
    conv_kernel: int  # the short convolution's width (conv_L_cache)
    conv_bias: bool  # the convolution's and its projections' biases
    intermediate_size: int  # the dense feed-forward's width (adjusted as LFM2 does)
    # LFM2-MoE's experts, in the layers ``sparse_layers``
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    expert_bias: bool = False  # the selection's bias (use_expert_bias)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @property
    def num_conv_layers(self) -> int:
        return self.layer_types.count(CONV)

    @classmethod
    def from_hf(cls, config: Any) -> Lfm2Arch:
        """The arch of an ``lfm2`` or ``lfm2_moe`` config; ``ValueError`` for another, or
        for layer kinds transformers does not compute."""
        if config.model_type not in ("lfm2", "lfm2_moe"):
            raise ValueError(f"model_type {config.model_type!r} is not lfm2 or lfm2_moe")
        kinds = tuple(config.layer_types)
        if set(kinds) - {CONV, ATTENTION} or len(kinds) != config.num_hidden_layers:
            raise ValueError(f"layer_types {list(kinds)}: one of {CONV!r} or {ATTENTION!r} for "
                             f"each of the {config.num_hidden_layers} layers")  # fmt: skip
        if config.conv_L_cache < 1:
            raise ValueError(f"conv_L_cache {config.conv_L_cache} must be at least 1")
        rope = rope_parameters(config)
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_layers=kinds.count(ATTENTION),
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.norm_eps,
            max_position_embeddings=max_positions(config.max_position_embeddings, rope),
            tie_word_embeddings=bool(config.tie_word_embeddings),
            rope=rope,
            layer_types=kinds,
            conv_kernel=config.conv_L_cache,
            conv_bias=bool(config.conv_bias),
            intermediate_size=feed_forward_width(config),
            **_experts(config, len(kinds)),
        )


def feed_forward_width(config: Any) -> int:
    """The dense MLP's width, as transformers' ``Lfm2MLP`` derives it (module docstring);
    LFM2-MoE's config has no ``block_auto_adjust_ff_dim``: its width as given."""
    width = config.intermediate_size
    if not getattr(config, "block_auto_adjust_ff_dim", False):
        return width
    width = int(2 * width / 3)
    if config.block_ffn_dim_multiplier is not None:
        width = int(config.block_ffn_dim_multiplier * width)
        multiple = config.block_multiple_of
        width = multiple * -(-width // multiple)
    return width


def _experts(config: Any, num_layers: int) -> dict[str, Any]:
    """The arch's expert fields: LFM2-MoE's past its first ``num_dense_layers``."""
    if config.model_type != "lfm2_moe":
        return {}
    return dict(
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        sparse_layers=tuple(range(config.num_dense_layers, num_layers)),
        expert_bias=bool(config.use_expert_bias),
        norm_topk_prob=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor),
    )


class ShortConv(nn.Module):
    """The gated short convolution (module docstring): (num_tokens, hidden) ->
    (num_tokens, hidden), reading and writing each sequence's state in its slot."""

    def __init__(self, a: Lfm2Arch) -> None:
        super().__init__()
        h = a.hidden_size
        self.in_proj = nn.Linear(h, 3 * h, bias=a.conv_bias)  # rows [B | C | x]
        self.conv_weight = nn.Parameter(torch.empty(h, a.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(h)) if a.conv_bias else None
        self.out_proj = nn.Linear(h, h, bias=a.conv_bias)

    def forward(
        self, h: torch.Tensor, states: tuple[torch.Tensor], step: RecurrentStep
    ) -> torch.Tensor:
        b, c, x = self.in_proj(h).chunk(3, dim=-1)
        return self.out_proj(c * self._conv(b * x, states[0], step))

    def _conv(self, bx: torch.Tensor, pool: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        """``bx`` (num_tokens, hidden) convolved, each sequence after its slot's state in
        ``pool`` (none when fresh), its state after its last token written back."""
        if step.decode_only:
            return self._decode(bx, pool, step.groups[0].slots)
        out = bx.new_zeros(bx.shape)
        for group in step.groups:
            out.index_copy_(0, group.rows, self._decode(bx.index_select(0, group.rows), pool,
                                                        group.slots))  # fmt: skip
            step.after(group, pool)
        for chunk in step.prefills:
            rows = slice(chunk.start, chunk.start + chunk.n)
            state = None if chunk.fresh else pool[chunk.slot]
            out[rows], pool[chunk.slot] = causal_conv1d(
                bx[rows], self.conv_weight, state, self.conv_bias, silu=False
            )
        return out

    def _decode(self, bx: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One token of each decoding sequence (row i's state in ``slots[i]``)."""
        out, states = causal_conv1d_step(
            bx, self.conv_weight, pool.index_select(0, slots), self.conv_bias, silu=False
        )
        pool.index_copy_(0, slots, states)
        return out

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From the checkpoint tensors of ``p`` (``layers.N.conv.``): ``in_proj``,
        ``conv`` (a depthwise ``Conv1d``: (hidden, 1, kernel)), ``out_proj``."""
        kinds = ("weight", "bias") if self.conv_bias is not None else ("weight",)
        for kind in kinds:
            getattr(self.in_proj, kind).copy_(sd[f"{p}in_proj.{kind}"])
            getattr(self.out_proj, kind).copy_(sd[f"{p}out_proj.{kind}"])
        self.conv_weight.copy_(sd[p + "conv.weight"].reshape(self.conv_weight.shape))
        if self.conv_bias is not None:
            self.conv_bias.copy_(sd[p + "conv.bias"])


class Lfm2Attention(nn.Module):
    """Grouped-query attention with per-head q/k norms, through the paged KV cache: fused
    ``qkv_proj``, ``o_proj`` (the checkpoint's ``out_proj``)."""

    def __init__(self, a: Lfm2Arch) -> None:
        super().__init__()
        self.a = a
        init_projections(self, a, False, False, mlp=False)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.attn_forward = _no_attention_backend  # set_attention_backend
        self.scale = a.head_dim**-0.5

    def forward(self, positions, h, rope: RotaryEmbedding, meta: Any, kv_cache) -> torch.Tensor:
        a = self.a
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, a.num_heads, a.head_dim)).view(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, a.num_kv_heads, a.head_dim)).view(-1, self.kv_size)
        rope(positions, q, k)  # in place: the norms' new tensors
        attn = self.attn_forward(
            q.view(-1, a.num_heads, a.head_dim),
            k.view(-1, a.num_kv_heads, a.head_dim),
            v.view(-1, a.num_kv_heads, a.head_dim),
            kv_cache,
            meta,
            self.scale,
        )  # (num_tokens, heads, head_dim)
        return self.o_proj(attn.reshape(-1, self.q_size))

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From the checkpoint tensors of ``p`` (``layers.N.self_attn.``)."""
        self.qkv_proj.weight.copy_(torch.cat([sd[f"{p}{n}_proj.weight"] for n in "qkv"]))
        self.o_proj.weight.copy_(sd[p + "out_proj.weight"])
        self.q_norm.weight.copy_(sd[p + "q_layernorm.weight"])
        self.k_norm.weight.copy_(sd[p + "k_layernorm.weight"])


class Lfm2MoeBlock(nn.Module):
    """LFM2-MoE's routed experts (module docstring): (num_tokens, hidden) -> (num_tokens,
    hidden). The router ``gate``, ``expert_bias`` (where the config uses one) and the
    SiLU-gated experts (``FusedMoE``)."""

    def __init__(self, a: Lfm2Arch) -> None:
        super().__init__()
        self.a = a
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(a.num_experts)) if a.expert_bias else None
        self.experts = FusedMoE(a.num_experts, a.num_experts_per_tok, a.hidden_size,
                                a.moe_intermediate_size, renormalize=a.norm_topk_prob)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        # One group, unscaled and not renormalised: transformers' own renormalisation after.
        weights, ids = select_experts_grouped(self.gate(x), self.expert_bias,
                                              a.num_experts_per_tok, 1, 1, False, 1.0)  # fmt: skip
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTING_EPS)
        return self.experts.apply(x, weights * a.routed_scaling_factor, ids)

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From ``p`` (``layers.N.feed_forward.``): each expert's ``experts.E.w1`` /
        ``w3`` / ``w2`` (gate, up, down: the Hub's), or all stacked (``experts.gate_up_proj``,
        ``experts.down_proj``: transformers 5's)."""
        a = self.a
        self.gate.weight.copy_(sd[p + "gate.weight"])
        if self.expert_bias is not None:
            self.expert_bias.copy_(sd[p + "expert_bias"])
        i, e = a.moe_intermediate_size, a.num_experts
        if p + "experts.gate_up_proj" in sd:
            gate_up = stacked_experts(sd, p + "experts.gate_up_proj", (e, 2 * i, a.hidden_size))
            down = stacked_experts(sd, p + "experts.down_proj", (e, a.hidden_size, i))
            for n in range(e):
                self.experts.load_expert(n, gate_up[n, :i], gate_up[n, i:], down[n])
            return
        for n in range(e):
            gate, up, down = (sd[f"{p}experts.{n}.{w}.weight"] for w in ("w1", "w3", "w2"))
            self.experts.load_expert(n, gate, up, down)


class Lfm2Layer(nn.Module):
    def __init__(self, a: Lfm2Arch, i: int) -> None:
        super().__init__()
        self.is_conv = a.layer_types[i] == CONV
        if self.is_conv:
            self.conv = ShortConv(a)
        else:
            self.self_attn = Lfm2Attention(a)
        sparse = i in a.sparse_layers
        self.feed_forward = (
            Lfm2MoeBlock(a) if sparse else DenseMLP(a.hidden_size, a.intermediate_size)
        )
        self.operator_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.ffn_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class Lfm2ForCausalLM(HybridCausalLM):
    """LFM2 (``lfm2``), and LFM2-MoE through ``Lfm2MoeForCausalLM`` (module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Lfm2Arch:
        return Lfm2Arch.from_hf(hf_config)

    def __init__(self, arch: Lfm2Arch) -> None:
        super().__init__(arch)  # its final norm: the checkpoint's embedding_norm
        # Each layer's place among its kind's: its KV cache, or its recurrent state.
        kinds = arch.layer_types
        self._index = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]

    def make_layer(self, i: int) -> nn.Module:
        return Lfm2Layer(self.arch, i)

    def set_attention_backend(self, backend: Any) -> None:
        for layer in self.layers:
            if not layer.is_conv:
                layer.self_attn.attn_forward = backend.forward

    def recurrent_state_specs(self, ssm_dtype: torch.dtype) -> list[tuple[StateSpec]]:
        """Per convolution layer, in order: its last inputs (hidden, kernel - 1) in the
        weights' dtype (``ssm_dtype`` is not read: LFM2 has no SSM state)."""
        a = self.arch
        conv = StateSpec((a.hidden_size, a.conv_kernel - 1), self.embed_tokens.weight.dtype)
        return [(conv,)] * a.num_conv_layers

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        layer, j = self.layers[i], self._index[i]
        h = layer.operator_norm(x)
        if layer.is_conv:
            h = mixers.recurrent(layer.conv, j, h)
        else:
            h = mixers.attention(layer.self_attn, j, h)
        x = x + h
        return x + layer.feed_forward(layer.ffn_norm(x))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (``model.layers...``; others ignored), fusing
        q/k/v and w1/w3; ``ValueError`` naming a missing tensor."""
        sd = CheckpointTensors({k.removeprefix("model."): v for k, v in sd.items()})
        self.init_buffers()
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
            self.norm.weight.copy_(sd["embedding_norm.weight"])
            if not self.arch.tie_word_embeddings:
                self.lm_head.weight.copy_(sd["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                if layer.is_conv:
                    layer.conv.load(sd, p + "conv.")
                else:
                    layer.self_attn.load(sd, p + "self_attn.")
                for norm in ("operator_norm", "ffn_norm"):
                    getattr(layer, norm).weight.copy_(sd[f"{p}{norm}.weight"])
                self._load_feed_forward(layer.feed_forward, sd, p + "feed_forward.")

    @staticmethod
    def _load_feed_forward(ff: nn.Module, sd: dict[str, torch.Tensor], p: str) -> None:
        if isinstance(ff, Lfm2MoeBlock):
            ff.load(sd, p)
            return
        ff.gate_up_proj.weight.copy_(torch.cat([sd[p + "w1.weight"], sd[p + "w3.weight"]]))
        ff.down_proj.weight.copy_(sd[p + "w2.weight"])


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2-MoE (``lfm2_moe``: LFM2-8B-A1B; module docstring)."""


__all__ = ["Lfm2Arch", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM"]
