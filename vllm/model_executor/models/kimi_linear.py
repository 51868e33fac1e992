"""Moonshot's Kimi-Linear (``KimiLinearForCausalLM``: Kimi-Linear-48B-A3B), as transformers
computes it: a hybrid whose layers (``layer_types``, from the checkpoint's
``linear_attn_config``: ``kda_layers`` and ``full_attn_layers``, counted from 1) are Kimi
Delta Attention or multi-head latent attention, each a pre-norm mixer and a pre-norm
feed-forward summed into the residual stream.

- **KDA** (``layers/kda.py``): q, k, v projected (``q_proj``, ``k_proj``, ``v_proj``; one
  fused projection here, with the low-rank inputs ``f_a_proj`` and ``g_a_proj`` and
  ``b_proj``), each through its depthwise causal convolution (``q_conv1d``... no bias)
  and SiLU; the decay per key channel from ``f_b_proj(f_a_proj(x))`` plus ``dt_bias``,
  scaled by ``-exp(A_log)`` per head; ``beta = sigmoid(b_proj(x))``; the gated delta rule;
  the output RMS-normalised per head (``o_norm``) times ``sigmoid(g_b_proj(g_a_proj(x)))``,
  then ``o_proj``. Its states live in the recurrent pools (``layers/recurrent.py``).
- **MLA**: DeepSeek-V2's latent attention (``deepseek_v2.MLAttention``: cached as the
  latent) with no rotation at all (NoPE: transformers' ``KimiLinearAttention`` never
  rotates; the ``qk_rope_head_dim`` part of each key is the shared ``k_pe`` as projected),
  softmax scale ``qk_head_dim ** -0.5``.
- **Feed-forward**: the dense SiLU MLP in the layers ``mlp_layer_types`` marks dense (the
  first ``first_k_dense_replace``), else DeepSeek-V3's experts (``deepseek_v2.DeepseekMoE``:
  sigmoid scores plus ``e_score_correction_bias`` within the best groups, renormalised
  under ``moe_renormalize``, times ``routed_scaling_factor``, plus the shared experts).

The checkpoint's tensors are read under the names the Hub's files hold: ``self_attn.
{f_a_proj, f_b_proj, A_log (1, 1, heads, 1), dt_bias, q_conv1d, k_conv1d, v_conv1d}``,
``block_sparse_moe.{gate, experts.N.{w1, w2, w3}, shared_experts}``, a dense layer's
``mlp.{gate,up,down}_proj``. transformers renames them on load (``self_attn.
forget_gate.*``, one stacked ``self_attn.conv1d``, the experts under ``mlp.`` stacked as
``experts.gate_up_proj`` / ``down_proj``) and its ``save_pretrained`` writes them back
as the Hub's, but for the dense layers' MLP, written under ``block_sparse_moe.`` too;
tensors under any of those names load.

The arch's ``num_layers`` and head shapes are the MLA layers' KV cache (one latent head of
``kv_lora_rank + qk_rope_head_dim`` a token); ``layer_types`` holds every layer's kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.layers.kda import KDAShape, KimiDeltaMixer
from vllm.model_executor.layers.recurrent import RecurrentStep, StateSpec
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekMoE,
    DeepseekV2Arch,
    DenseMLP,
    MLAttention,
)
from vllm.model_executor.models.hybrid_base import CheckpointTensors, HybridCausalLM, StepMixers
from vllm.model_executor.models.llama import RMSNorm, layer_attention, load_embeddings_and_head

LINEAR, FULL = "linear_attention", "full_attention"
# linear_attn_config keys of later Kimi models that transformers' Kimi-Linear does not run.
UNSUPPORTED_KDA_KEYS = ("use_full_rank_gate", "gate_lower_bound")


@dataclass(frozen=True)
class KimiLinearArch:
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # every decoder layer's: LINEAR or FULL
    intermediate_size: int  # the dense MLP's
    sparse_layers: tuple[int, ...]  # the layers whose feed-forward is the experts
    kda: KDAShape
    # The MLA layers' and the experts' shapes (MLAttention and DeepseekMoE read them).
    mla: DeepseekV2Arch
    rope: ClassVar[None] = None  # NoPE: no rotary table

    @property
    def num_layers(self) -> int:
        """The MLA layers: the KV cache's."""
        return self.mla.num_layers

    @property
    def num_heads(self) -> int:
        return self.mla.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.mla.num_kv_heads

    @property
    def head_dim(self) -> int:
        """The cache's head: the latent plus the shared key part."""
        return self.mla.head_dim

    @property
    def latent_value_size(self) -> int:
        return self.mla.latent_value_size

    @classmethod
    def from_hf(cls, config: Any) -> KimiLinearArch:
        """The arch of a ``kimi_linear`` config; ``ValueError`` naming the field for what
        transformers' code does not compute."""
        _check(config)
        types = tuple(config.layer_types)
        if set(types) - {LINEAR, FULL} or len(types) != config.num_hidden_layers:
            raise ValueError(f"layer_types {list(types)}: one of {LINEAR!r} or {FULL!r} for "
                             f"each of the {config.num_hidden_layers} layers")  # fmt: skip
        mlp_types = list(config.mlp_layer_types)
        sparse = tuple(i for i, kind in enumerate(mlp_types) if kind == "sparse")
        if set(mlp_types) - {"dense", "sparse"} or len(mlp_types) != len(types):
            raise ValueError(f"mlp_layer_types {mlp_types}: 'dense' or 'sparse' for each layer")
        return cls(
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            # transformers' Kimi-Linear never ties its head (no tied weights keys), whatever
            # tie_word_embeddings says: the checkpoint's lm_head is read.
            tie_word_embeddings=False,
            layer_types=types,
            intermediate_size=config.intermediate_size,
            sparse_layers=sparse,
            kda=KDAShape(
                num_heads=config.linear_num_heads,
                head_dim=config.linear_head_dim,
                conv_kernel=config.linear_conv_kernel_dim,
            ),
            mla=_mla_arch(config, types.count(FULL), sparse),
        )


def _check(config: Any) -> None:
    """``ValueError`` naming a field whose value transformers' Kimi-Linear ignores or
    cannot run (it would compute something else than the checkpoint means)."""
    if config.model_type != "kimi_linear":
        raise ValueError(f"model_type {config.model_type!r} is not Kimi-Linear")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    if getattr(config, "mla_use_nope", True) is False:
        raise ValueError("mla_use_nope False: Kimi-Linear's latent attention is unrotated")
    scoring = getattr(config, "moe_router_activation_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"moe_router_activation_func {scoring!r} is not supported ('sigmoid')")
    kda = getattr(config, "linear_attn_config", None) or {}
    for key in UNSUPPORTED_KDA_KEYS:
        if kda.get(key) not in (None, False):
            raise ValueError(f"linear_attn_config {key} {kda[key]!r} is not supported")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if kv_heads != heads:
        raise ValueError(f"num_key_value_heads {kv_heads}: latent attention expands one key "
                         f"per head (num_attention_heads {heads})")  # fmt: skip


def _mla_arch(config: Any, num_layers: int, sparse: tuple[int, ...]) -> DeepseekV2Arch:
    """DeepSeek-V2's arch for the MLA layers and the experts (no rotation: its rotary
    fields are never read)."""
    experts, groups, top_groups = config.num_local_experts, config.n_group, config.topk_group
    if sparse and (experts % groups or not 1 <= top_groups <= groups or experts // groups < 2):
        raise ValueError(
            f"num_expert_group {groups} / topk_group {top_groups}: groups of two or more of "
            f"the num_experts {experts} (a group ranks by its two best), topk_group of them"
        )
    return DeepseekV2Arch(
        hidden_size=config.hidden_size,
        num_layers=num_layers,
        num_heads=config.num_attention_heads,
        vocab_size=config.vocab_size,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        attention_bias=bool(getattr(config, "attention_bias", False)),
        rope_parameters={},
        rope_interleave=False,
        softmax_scale=(config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5,
        num_experts=experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        n_shared_experts=config.n_shared_experts or 0,
        sparse_layers=sparse,
        topk_method="noaux_tc",
        num_groups=groups,
        topk_groups=top_groups,
        norm_topk_prob=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor),
    )


def _no_rotation(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    """MLAttention's rotary hook for NoPE: the keys' and queries' shared part unrotated."""


class SigmoidGatedRMSNorm(nn.Module):
    """KDA's output norm: ``rms_norm(x) * weight * sigmoid(gate)`` per head, in fp32 (as
    transformers' ``KimiLinearRMSNormGated``), rounded to x's dtype at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """A KDA layer (module docstring): ``(num_tokens, hidden) -> (num_tokens, hidden)``."""

    def __init__(self, a: KimiLinearArch) -> None:
        super().__init__()
        s = self.shape = a.kda
        # rows [q | k | v | f_a | g_a | b]
        self.split = [s.conv_dim, s.head_dim, s.head_dim, s.num_heads]
        self.in_proj = nn.Linear(a.hidden_size, sum(self.split), bias=False)
        self.f_b_proj = nn.Linear(s.head_dim, s.qkv_dim, bias=False)
        self.g_b_proj = nn.Linear(s.head_dim, s.qkv_dim, bias=False)
        self.mixer = KimiDeltaMixer(s)
        self.o_norm = SigmoidGatedRMSNorm(s.head_dim, a.rms_norm_eps)
        self.o_proj = nn.Linear(s.qkv_dim, a.hidden_size, bias=False)

    def forward(
        self, h: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], step: RecurrentStep
    ) -> torch.Tensor:
        s = self.shape
        qkv, f_a, g_a, b = self.in_proj(h).split(self.split, dim=-1)
        core = self.mixer.mix(qkv, self.f_b_proj(f_a), b, states, step)  # (T, heads, head_dim)
        gate = self.g_b_proj(g_a).view(-1, s.num_heads, s.head_dim)
        return self.o_proj(self.o_norm(core, gate).reshape(-1, s.qkv_dim))

    @torch.no_grad()
    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From the checkpoint tensors of ``p`` (``layers.N.self_attn.``)."""
        s, m = self.shape, self.mixer
        # transformers' own names keep the decay's tensors under forget_gate.
        f = p + "forget_gate." if p + "forget_gate.A_log" in sd else p
        names = (p + "q_proj", p + "k_proj", p + "v_proj", f + "f_a_proj", p + "g_a_proj",
                 p + "b_proj")  # fmt: skip
        self.in_proj.weight.copy_(torch.cat([sd[n + ".weight"] for n in names]))
        if p + "conv1d.weight" in sd:  # transformers' own: q's, k's, v's stacked
            conv = sd[p + "conv1d.weight"]
        else:
            conv = torch.cat([sd[f"{p}{n}_conv1d.weight"] for n in "qkv"])
        m.conv_weight.copy_(conv.reshape(s.conv_dim, s.conv_kernel))
        m.A_log.copy_(sd[f + "A_log"].reshape(s.num_heads))  # stored (1, 1, heads, 1)
        m.dt_bias.copy_(sd[f + "dt_bias"].reshape(s.qkv_dim))
        self.f_b_proj.weight.copy_(sd[f + "f_b_proj.weight"])
        for name in ("g_b_proj", "o_proj", "o_norm"):
            getattr(self, name).weight.copy_(sd[f"{p}{name}.weight"])


@torch.no_grad()
def load_experts(moe: DeepseekMoE, sd: dict[str, torch.Tensor], p: str) -> None:
    """The experts from the checkpoint tensors of ``p`` (``layers.N.block_sparse_moe.``):
    the router, its bias, each expert's ``w1`` (gate), ``w3`` (up), ``w2`` (down), the
    shared experts; or as transformers holds them (``layers.N.mlp.``, the experts stacked:
    DeepSeek's own load)."""
    if p + "experts.gate_up_proj" in sd:
        moe.load(sd, p)
        return
    moe.gate.weight.copy_(sd[p + "gate.weight"])
    moe.e_score_correction_bias.copy_(sd[p + "gate.e_score_correction_bias"])
    for e in range(moe.a.num_experts):
        gate, up, down = (sd[f"{p}experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
        moe.experts.load_expert(e, gate, up, down)
    if moe.shared_experts is not None:
        moe.shared_experts.load(sd, p + "shared_experts.")


def feed_forward_prefix(sd: dict[str, torch.Tensor], p: str, hub: str) -> str:
    """Where layer ``p``'s feed-forward tensors are: under ``hub`` (the Hub's files: a
    dense layer's ``mlp.``, the experts' ``block_sparse_moe.``), else under the other
    name, if its tensors are there (transformers names both ``mlp.`` and its
    ``save_pretrained`` writes both as ``block_sparse_moe.``)."""
    other = "block_sparse_moe." if hub == "mlp." else "mlp."
    first = "gate.weight" if hub == "block_sparse_moe." else "gate_proj.weight"
    return p + (other if p + hub + first not in sd and p + other + first in sd else hub)


class KimiLinearLayer(nn.Module):
    def __init__(self, a: KimiLinearArch, i: int) -> None:
        super().__init__()
        self.linear = a.layer_types[i] == LINEAR
        self.self_attn = KimiDeltaAttention(a) if self.linear else MLAttention(a.mla)
        self.sparse = i in a.sparse_layers
        self.mlp = DeepseekMoE(a.mla) if self.sparse else DenseMLP(a.hidden_size,
                                                                   a.intermediate_size)  # fmt: skip
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class KimiLinearForCausalLM(HybridCausalLM):
    """Kimi-Linear (module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> KimiLinearArch:
        return KimiLinearArch.from_hf(hf_config)

    def __init__(self, arch: KimiLinearArch) -> None:
        super().__init__(arch)
        # Each layer's place among its kind's: its KV cache, or its recurrent states.
        kinds = arch.layer_types
        self._index = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]

    def make_layer(self, i: int) -> nn.Module:
        return KimiLinearLayer(self.arch, i)

    def set_attention_backend(self, backend: Any) -> None:
        """The MLA layers attend with ``backend``: multi-query attention over the latent
        (``arch.num_kv_heads`` 1), its values the keys' first ``latent_value_size`` dims."""
        for layer in self.layers:
            if not layer.linear:
                layer.self_attn.attn_forward = layer_attention(backend)

    def recurrent_state_specs(self, ssm_dtype: torch.dtype) -> list[tuple[StateSpec, StateSpec]]:
        """Per KDA layer, in order: (its convolutions' last inputs (3 * qkv_dim, kernel -
        1) in the weights' dtype, its delta-rule state (heads, head_dim, head_dim) in
        ``ssm_dtype``)."""
        s = self.arch.kda
        conv = StateSpec((s.conv_dim, s.conv_kernel - 1), self.embed_tokens.weight.dtype)
        ssm = StateSpec((s.num_heads, s.head_dim, s.head_dim), ssm_dtype)
        return [(conv, ssm)] * self.arch.layer_types.count(LINEAR)

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        layer, j = self.layers[i], self._index[i]
        h = layer.input_layernorm(x)
        if layer.linear:
            h = mixers.recurrent(layer.self_attn, j, h)
        else:  # unrotated latent attention
            h = layer.self_attn(mixers.positions, h, _no_rotation, mixers.metas[j],
                                mixers.kv_caches[j])  # fmt: skip
        x = x + h
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (``model.layers...``, the Hub's names: module
        docstring; others ignored), fusing the projections; ``ValueError`` naming a
        missing tensor."""
        sd = CheckpointTensors({k.removeprefix("model."): v for k, v in sd.items()})
        self.init_buffers()
        with torch.no_grad():
            load_embeddings_and_head(self, sd)
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                layer.self_attn.load(sd, p + "self_attn.")
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    getattr(layer, norm).weight.copy_(sd[f"{p}{norm}.weight"])
                if layer.sparse:
                    load_experts(layer.mlp, sd, feed_forward_prefix(sd, p, "block_sparse_moe."))
                else:
                    layer.mlp.load(sd, feed_forward_prefix(sd, p, "mlp."))


__all__ = ["KimiLinearArch", "KimiLinearForCausalLM"]
