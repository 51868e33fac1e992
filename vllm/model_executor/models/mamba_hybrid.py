"""Mamba2 hybrids: IBM Granite 4.0-H (``GraniteMoeHybridForCausalLM``), NVIDIA
Nemotron-H / Nemotron 3 Nano (``NemotronHForCausalLM``) and IBM Bamba
(``BambaForCausalLM``), as transformers computes them; TII's Falcon-H1, whose every layer
runs both mixers side by side, builds on this file (``falcon_h1.py``). Their Mamba2 layers
(``layers/mamba2.py``) keep per-sequence states in the recurrent pools
(``layers/recurrent.py``), as Qwen3-Next's Gated DeltaNet layers do; their attention
layers keep K/V in the paged cache.

- **Granite 4.0-H** (``granitemoehybrid``): each of ``layer_types`` ("mamba" or
  "attention"; transformers 5 names them "linear_attention" and "full_attention") is a
  pre-norm mixer and a pre-norm feed-forward, each output times ``residual_multiplier``
  before its residual sum. The feed-forward is the routed experts (softmax over the top
  k) plus the shared SiLU MLP (``shared_mlp``), or the shared MLP alone without experts
  (``moe.SparseMoeBlock`` with an ungated shared expert). Embeddings times
  ``embedding_multiplier``, attention scaled by ``attention_multiplier``, logits divided
  by ``logits_scaling``; attention rotates q and k only for ``position_embedding_type``
  "rope" (Granite 4.0-H's "nope" does not).
- **Nemotron-H** (``nemotron_h``): each layer is one norm and one mixer
  (``hybrid_override_pattern`` / ``layers_block_type``): Mamba2 ("M"), attention ("*",
  never rotated, no biases), a ReLU² MLP ("-") or, as Nemotron 3 Nano, experts ("E"):
  ReLU² experts routed by sigmoid scores plus a correction bias within the best groups
  (DeepSeek-V3's routing: ``fused_moe.select_experts_grouped``), optionally through a
  latent projection, plus a shared ReLU² expert. Its Mamba2 ``dt`` is clamped below at
  ``time_step_min``. The output head is never tied.
- **Bamba** (``bamba``): Granite 4.0-H's dense layers without its multipliers: Mamba2, or
  attention at ``attn_layer_indices``, then the SiLU-gated MLP (``feed_forward``), each
  pre-norm. Attention is scaled by ``head_dim ** -0.5`` and rotates the first half of
  each head (transformers hard-codes ``partial_rotary_factor`` 0.5 for Bamba).

The arch's ``num_layers`` and head counts are the attention layers' (the KV cache has a
tensor per attention layer); ``layer_types`` holds every layer's kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from vllm import _custom_ops as ops
from vllm.model_executor.layers.fused_moe import (
    Activation,
    fused_experts,
    select_experts_grouped,
)
from vllm.model_executor.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from vllm.model_executor.layers.recurrent import StateSpec
from vllm.model_executor.layers.rotary_embedding import max_positions, rope_parameters
from vllm.model_executor.models.hybrid_base import (
    CheckpointTensors,
    HybridCausalLM,
    StepMixers,
    layer_places,
)
from vllm.model_executor.models.llama import (
    RMSNorm,
    RotaryEmbedding,
    _no_attention_backend,
    init_projections,
    load_embeddings_and_head,
)
from vllm.model_executor.models.moe import SparseMoeBlock
from vllm.model_executor.models.qwen3_next import DenseMLP

MAMBA, ATTENTION, MLP, MOE = "mamba", "attention", "mlp", "moe"
PARALLEL = "parallel"  # Mamba2 and attention side by side (Falcon-H1's "hybrid")
# Every spelling of a layer's kind: transformers 5's, the Hub configs', Nemotron's pattern.
_KINDS = {
    "mamba": MAMBA, "linear_attention": MAMBA, "M": MAMBA,
    "attention": ATTENTION, "full_attention": ATTENTION, "*": ATTENTION,
    "mlp": MLP, "-": MLP, "moe": MOE, "E": MOE, "hybrid": PARALLEL,
}  # fmt: skip
_WITH_KV, _WITH_STATES = (ATTENTION, PARALLEL), (MAMBA, PARALLEL)


@dataclass(frozen=True)
class HybridArch:
    hidden_size: int
    num_layers: int  # the attention layers: the KV cache's
    num_heads: int  # the attention layers' shapes
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # every layer's kind: MAMBA, ATTENTION, MLP, MOE, PARALLEL
    mamba: Mamba2Shape
    attention_scale: float
    rope: dict[str, Any] | None = None  # rotary_embedding.rope_parameters'; None: unrotated
    attention_bias: bool = False  # q/k/v's and o's
    # Granite's scalars (1: none)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    intermediate_size: int = 0  # the dense MLP's (Granite's shared MLP, Nemotron's "-")
    mlp_bias: bool = False
    # The experts (moe.SparseMoeBlock reads these by name; Granite's shared MLP is its
    # ungated shared expert, Nemotron's has its own).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    num_groups: int = 1  # Nemotron's grouped routing
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    moe_latent_size: int | None = None  # Nemotron: the experts' width in and out
    scoring: ClassVar[str] = "softmax"
    shared_expert_gated: ClassVar[bool] = False

    @property
    def num_mamba_layers(self) -> int:
        return sum(kind in _WITH_STATES for kind in self.layer_types)


def _layer_kinds(names: Any, allowed: tuple[str, ...], field: str) -> tuple[str, ...]:
    kinds = tuple(_KINDS.get(n) for n in names)
    if not kinds or any(k not in allowed for k in kinds):
        raise ValueError(f"{field} {list(names)}: each layer one of {list(allowed)}")
    return kinds


def _heads(config: Any, kinds: tuple[str, ...], head_dim: int | None) -> dict[str, Any]:
    heads = config.num_attention_heads
    return dict(
        hidden_size=config.hidden_size,
        num_layers=sum(kind in _WITH_KV for kind in kinds),
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim or config.hidden_size // heads,
        vocab_size=config.vocab_size,
        layer_types=kinds,
    )


def granite_arch(config: Any) -> HybridArch:
    """The arch of a ``granitemoehybrid`` config; ``ValueError`` for what this engine does
    not compute as transformers does."""
    if config.model_type != "granitemoehybrid":
        raise ValueError(f"model_type {config.model_type!r} is not granitemoehybrid")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    kinds = _layer_kinds(config.layer_types, (MAMBA, ATTENTION), "layer_types")
    if config.mamba_n_heads * config.mamba_d_head != config.mamba_expand * config.hidden_size:
        raise ValueError("mamba_n_heads * mamba_d_head must be mamba_expand * hidden_size")
    rotate = getattr(config, "position_embedding_type", None) == "rope"
    rope = rope_parameters(config) if rotate else None
    experts = config.num_local_experts or 0
    return HybridArch(
        **_heads(config, kinds, None),
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=max_positions(
            config.max_position_embeddings, rope or {"rope_type": "none"}
        ),
        tie_word_embeddings=bool(config.tie_word_embeddings),
        mamba=mamba_shape(config),
        attention_scale=config.attention_multiplier,
        rope=rope,
        attention_bias=bool(config.attention_bias),
        embedding_multiplier=config.embedding_multiplier,
        residual_multiplier=config.residual_multiplier,
        logits_scaling=config.logits_scaling,
        intermediate_size=config.shared_intermediate_size,
        num_experts=experts,
        num_experts_per_tok=config.num_experts_per_tok if experts else 0,
        moe_intermediate_size=config.intermediate_size if experts else 0,
        shared_expert_intermediate_size=config.shared_intermediate_size if experts else 0,
    )


def nemotron_h_arch(config: Any) -> HybridArch:
    """The arch of a ``nemotron_h`` config; ``ValueError`` for what this engine does not
    compute as transformers does."""
    if config.model_type != "nemotron_h":
        raise ValueError(f"model_type {config.model_type!r} is not nemotron_h")
    for field, served in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        if getattr(config, field) != served:
            raise ValueError(f"{field} {getattr(config, field)!r} is not supported "
                             f"(only {served!r})")  # fmt: skip
    names = getattr(config, "layers_block_type", None) or config.hybrid_override_pattern
    kinds = _layer_kinds(names, (MAMBA, ATTENTION, MLP, MOE), "layers_block_type")
    arch = _heads(config, kinds, getattr(config, "head_dim", None))
    experts = dict(
        num_experts=config.n_routed_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        norm_topk_prob=bool(config.norm_topk_prob),
        shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        num_groups=config.n_group,
        topk_groups=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
        moe_latent_size=config.moe_latent_size,
    )
    return HybridArch(
        **arch,
        rms_norm_eps=config.layer_norm_epsilon,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=False,  # transformers ties nothing (_tied_weights_keys {})
        mamba=Mamba2Shape(
            hidden_size=config.hidden_size,
            num_heads=config.mamba_num_heads,
            head_dim=config.mamba_head_dim,
            n_groups=config.n_groups,
            state_size=config.ssm_state_size,
            conv_kernel=config.conv_kernel,
            chunk_size=config.chunk_size,
            rms_norm_eps=config.layer_norm_epsilon,
            # transformers' mixer clamps at time_step_min, whatever time_step_limit says
            dt_limit=(float(config.time_step_min), math.inf),
            proj_bias=bool(config.use_bias),
            conv_bias=bool(config.use_conv_bias),
        ),
        attention_scale=arch["head_dim"] ** -0.5,
        intermediate_size=config.intermediate_size,
        mlp_bias=bool(config.mlp_bias),
        **(experts if MOE in kinds else {}),
    )


def bamba_arch(config: Any) -> HybridArch:
    """The arch of a ``bamba`` config; ``ValueError`` for what this engine does not compute
    as transformers does."""
    if config.model_type != "bamba":
        raise ValueError(f"model_type {config.model_type!r} is not bamba")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    kinds = _layer_kinds(config.layers_block_type, (MAMBA, ATTENTION), "layers_block_type")
    arch = _heads(config, kinds, getattr(config, "head_dim", None))
    rope = rope_parameters(config)  # with transformers' partial_rotary_factor (0.5)
    return HybridArch(
        **arch,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=max_positions(config.max_position_embeddings, rope),
        tie_word_embeddings=bool(config.tie_word_embeddings),
        mamba=mamba_shape(config),
        attention_scale=arch["head_dim"] ** -0.5,
        rope=rope,
        attention_bias=bool(config.attention_bias),
        intermediate_size=config.intermediate_size,
        mlp_bias=bool(config.mlp_bias),
    )


def mamba_shape(config: Any, **changes: Any) -> Mamba2Shape:
    """The Mamba2 mixer of a config that names it with ``mamba_*`` fields (Granite 4.0-H,
    Bamba, Falcon-H1), dt clamped to its ``time_step_limit`` (None: unclamped); ``changes``
    a family's own options."""
    low, high = getattr(config, "time_step_limit", None) or (0.0, math.inf)
    return Mamba2Shape(
        hidden_size=config.hidden_size,
        num_heads=config.mamba_n_heads,
        head_dim=config.mamba_d_head,
        n_groups=config.mamba_n_groups,
        state_size=config.mamba_d_state,
        conv_kernel=config.mamba_d_conv,
        chunk_size=config.mamba_chunk_size,
        rms_norm_eps=config.rms_norm_eps,
        dt_limit=(float(low), float(high)),
        proj_bias=bool(config.mamba_proj_bias),
        conv_bias=bool(config.mamba_conv_bias),
        **changes,
    )


class HybridAttention(nn.Module):
    """Multi-head attention (GQA) through the paged KV cache, rotated where the arch has
    a rotary table: fused ``qkv_proj``, ``o_proj``."""

    def __init__(self, a: HybridArch) -> None:
        super().__init__()
        self.a = a
        init_projections(self, a, a.attention_bias, a.attention_bias, mlp=False)
        self.attn_forward = _no_attention_backend  # set_attention_backend

    def forward(self, positions, h, rope: RotaryEmbedding | None, meta, kv_cache) -> torch.Tensor:
        a = self.a
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if rope is not None:
            rope(positions, q, k)  # in place: strided views of the projection
        attn = self.attn_forward(
            q.view(-1, a.num_heads, a.head_dim),
            k.view(-1, a.num_kv_heads, a.head_dim),
            v.view(-1, a.num_kv_heads, a.head_dim),
            kv_cache,
            meta,
            a.attention_scale,
        )  # (num_tokens, heads, head_dim)
        return self.o_proj(attn.reshape(-1, self.q_size))

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From the checkpoint tensors of ``p`` (``layers.N.self_attn.``, ``...mixer.``)."""
        for kind in ("weight", "bias") if self.a.attention_bias else ("weight",):
            getattr(self.qkv_proj, kind).copy_(torch.cat([sd[f"{p}{n}_proj.{kind}"]
                                                          for n in "qkv"]))  # fmt: skip
            getattr(self.o_proj, kind).copy_(sd[f"{p}o_proj.{kind}"])


class GatedMLP(nn.Module):
    """Bamba's and Falcon-H1's MLP: ``down_proj(silu(gate_proj(x) * g) * up_proj(x)) * d``,
    ``(g, d)`` Falcon-H1's ``mlp_multipliers`` (1: none); gate and up fused
    (``gate_up_proj``)."""

    def __init__(
        self, hidden: int, width: int, bias: bool, multipliers: tuple[float, float] = (1.0, 1.0)
    ) -> None:
        super().__init__()
        self.width = width
        self.gate_multiplier, self.down_multiplier = (float(m) for m in multipliers)
        self.gate_up_proj = nn.Linear(hidden, 2 * width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # (num_tokens, 2 * width): [gate | up]
        if self.gate_multiplier != 1.0:
            gate_up[:, : self.width] *= self.gate_multiplier
        out = self.down_proj(ops.silu_and_mul(gate_up))
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From ``p`` (``layers.N.feed_forward.``): ``gate_proj``, ``up_proj``,
        ``down_proj``."""
        for kind in ("weight", "bias") if self.down_proj.bias is not None else ("weight",):
            getattr(self.gate_up_proj, kind).copy_(
                torch.cat([sd[f"{p}gate_proj.{kind}"], sd[f"{p}up_proj.{kind}"]])
            )
            getattr(self.down_proj, kind).copy_(sd[f"{p}down_proj.{kind}"])


relu2 = Activation("relu2")  # Nemotron-H's MLPs and experts: ReLU squared, no gate


class Relu2MLP(nn.Module):
    """Nemotron-H's MLP: ``down_proj(relu(up_proj(x)) ** 2)``."""

    def __init__(self, hidden: int, width: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, width, bias=bias)
        self.down_proj = nn.Linear(width, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        for name in ("up_proj", "down_proj"):
            for kind in ("weight", "bias") if self.up_proj.bias is not None else ("weight",):
                getattr(getattr(self, name), kind).copy_(sd[f"{p}{name}.{kind}"])


class NemotronHMoE(nn.Module):
    """Nemotron-H's experts (module docstring): ``(num_tokens, hidden) -> (num_tokens,
    hidden)``. The routed experts ``w1`` (E, I, latent) and ``w2`` (E, latent, I), ReLU²
    between, run by ``fused_moe.fused_experts``."""

    def __init__(self, a: HybridArch) -> None:
        super().__init__()
        self.a = a
        width = a.moe_latent_size or a.hidden_size
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_experts))
        self.w1 = nn.Parameter(torch.empty(a.num_experts, a.moe_intermediate_size, width))
        self.w2 = nn.Parameter(torch.empty(a.num_experts, width, a.moe_intermediate_size))
        self.shared_experts = Relu2MLP(a.hidden_size, a.shared_expert_intermediate_size,
                                       a.mlp_bias)  # fmt: skip
        self.latent = a.moe_latent_size is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(a.hidden_size, width, bias=a.mlp_bias)
            self.fc2_latent_proj = nn.Linear(width, a.hidden_size, bias=a.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        logits = F.linear(x.float(), self.gate.weight.float())  # fp32, as transformers
        weights, ids = select_experts_grouped(
            logits, self.e_score_correction_bias, a.num_experts_per_tok, a.num_groups,
            a.topk_groups, a.norm_topk_prob, a.routed_scaling_factor,
        )  # fmt: skip
        h = self.fc1_latent_proj(x) if self.latent else x
        out = fused_experts(h, self.w1, self.w2, weights, ids, activation=relu2)
        if self.latent:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From ``p`` (``layers.N.mixer.``): each expert's ``experts.E.up_proj`` /
        ``down_proj`` (the Hub's), or all stacked (``experts.up_proj``, transformers 5's)."""
        self.gate.weight.copy_(sd[p + "gate.weight"])
        self.e_score_correction_bias.copy_(sd[p + "gate.e_score_correction_bias"])
        for ours, name in ((self.w1, "up_proj"), (self.w2, "down_proj")):
            if f"{p}experts.{name}" in sd:
                ours.copy_(sd[f"{p}experts.{name}"])
            else:
                for e in range(self.a.num_experts):
                    ours[e].copy_(sd[f"{p}experts.{e}.{name}.weight"])
        self.shared_experts.load(sd, p + "shared_experts.")
        if self.latent:
            for name in ("fc1_latent_proj", "fc2_latent_proj"):
                layer = getattr(self, name)
                layer.weight.copy_(sd[f"{p}{name}.weight"])
                if layer.bias is not None:
                    layer.bias.copy_(sd[f"{p}{name}.bias"])


class _MambaHybridForCausalLM(HybridCausalLM):
    """What the families share: embeddings, the layers' loop over a step (Mamba2 mixers
    on the recurrent pools, attention on the KV cache), the final norm and head."""

    def __init__(self, arch: HybridArch) -> None:
        super().__init__(arch)
        # Each layer's KV cache (its place among the layers with one) and recurrent states.
        kinds = arch.layer_types
        self._kv_index = layer_places(kinds, lambda k: k in _WITH_KV)
        self._state_index = layer_places(kinds, lambda k: k in _WITH_STATES)

    def set_attention_backend(self, backend: Any) -> None:
        for module in self.modules():
            if isinstance(module, HybridAttention):
                module.attn_forward = backend.forward

    def recurrent_state_specs(self, ssm_dtype: torch.dtype) -> list[tuple[StateSpec, ...]]:
        """Per Mamba2 layer, in order: (its convolution's last inputs (conv_dim, kernel -
        1) in the weights' dtype, its SSM state (heads, head_dim, state) in
        ``ssm_dtype``)."""
        specs = self.arch.mamba.state_specs(self.embed_tokens.weight.dtype, ssm_dtype)
        return [specs] * self.arch.num_mamba_layers

    @torch.inference_mode()
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        m = self.arch.embedding_multiplier
        return x * m if m != 1.0 else x

    def mix(self, i: int, h: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        """The output of layer ``i``'s one mixer (its ``mixer``) on ``h``."""
        kind, layer = self.arch.layer_types[i], self.layers[i]
        if kind == MAMBA:
            return mixers.recurrent(layer.mixer, self._state_index[i], h)
        if kind == ATTENTION:
            return mixers.attention(layer.mixer, self._kv_index[i], h)
        return layer.mixer(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits if self.arch.logits_scaling == 1.0 else logits / self.arch.logits_scaling

    def load_ends(self, sd: dict[str, torch.Tensor], norm: str) -> None:
        """The embeddings, the final norm (the tensor ``norm``) and the untied head (the
        embeddings where the checkpoint has none, as ``llama.load_embeddings_and_head``)."""
        self.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
        self.norm.weight.copy_(sd[norm])
        if not self.arch.tie_word_embeddings:
            self.lm_head.weight.copy_(sd.get("lm_head.weight", sd["embed_tokens.weight"]))

    def init_buffers(self) -> None:
        """``HybridCausalLM``'s, and the Mamba2 mixers' computed buffers."""
        super().init_buffers()
        for module in self.modules():
            if isinstance(module, Mamba2Mixer):
                module.init_buffers()


class GraniteHybridLayer(nn.Module):
    def __init__(self, a: HybridArch, kind: str) -> None:
        super().__init__()
        self.mixer = Mamba2Mixer(a.mamba) if kind == MAMBA else HybridAttention(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        dense = a.num_experts == 0
        self.mlp = DenseMLP(a.hidden_size, a.intermediate_size) if dense else SparseMoeBlock(a)


class GraniteMoeHybridForCausalLM(_MambaHybridForCausalLM):
    """IBM Granite 4.0-H (``granitemoehybrid``; module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> HybridArch:
        return granite_arch(hf_config)

    def make_layer(self, i: int) -> nn.Module:
        return GraniteHybridLayer(self.arch, self.arch.layer_types[i])

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        layer = self.layers[i]
        m = self.arch.residual_multiplier
        x = x + self.mix(i, layer.input_layernorm(x), mixers) * m
        return x + layer.mlp(layer.post_attention_layernorm(x)) * m

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (``model.layers...``; others ignored), fusing
        the projections; ``ValueError`` naming a missing tensor."""
        sd = CheckpointTensors({k.removeprefix("model."): v for k, v in sd.items()})
        self.init_buffers()
        with torch.no_grad():
            load_embeddings_and_head(self, sd)
            for i, (layer, kind) in enumerate(zip(self.layers, self.arch.layer_types, strict=True)):
                p = f"layers.{i}."
                layer.mixer.load(sd, p + ("mamba." if kind == MAMBA else "self_attn."))
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    getattr(layer, norm).weight.copy_(sd[f"{p}{norm}.weight"])
                self._load_mlp(layer.mlp, sd, p)

    def _load_mlp(self, mlp: nn.Module, sd: dict[str, torch.Tensor], p: str) -> None:
        """The shared MLP (``shared_mlp.input_linear``: [gate; up]) and the experts: the
        Hub's ``block_sparse_moe.input_linear`` / ``output_linear`` / ``router.layer``, or
        transformers 5's ``experts.gate_up_proj`` / ``experts.down_proj`` / ``router``."""
        shared = [sd[f"{p}shared_mlp.{n}_linear.weight"] for n in ("input", "output")]
        if not isinstance(mlp, SparseMoeBlock):
            mlp.gate_up_proj.weight.copy_(shared[0])
            mlp.down_proj.weight.copy_(shared[1])
            return
        if mlp.shared:
            mlp.shared_gate_up_proj.weight.copy_(shared[0])
            mlp.shared_down_proj.weight.copy_(shared[1])
        e = p + "block_sparse_moe."
        hub = e + "input_linear.weight" in sd
        names = ("input_linear.weight", "output_linear.weight", "router.layer.weight") if hub else (
            "experts.gate_up_proj", "experts.down_proj", "router.weight"
        )  # fmt: skip
        params = (mlp.experts.w13, mlp.experts.w2, mlp.gate.weight)
        for param, name in zip(params, names, strict=True):
            param.copy_(sd[e + name])


class NemotronHBlock(nn.Module):
    def __init__(self, a: HybridArch, kind: str) -> None:
        super().__init__()
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(a.mamba)
        elif kind == ATTENTION:
            self.mixer = HybridAttention(a)
        elif kind == MLP:
            self.mixer = Relu2MLP(a.hidden_size, a.intermediate_size, a.mlp_bias)
        else:
            self.mixer = NemotronHMoE(a)


class NemotronHForCausalLM(_MambaHybridForCausalLM):
    """NVIDIA Nemotron-H and Nemotron 3 Nano (``nemotron_h``; module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> HybridArch:
        return nemotron_h_arch(hf_config)

    @staticmethod
    def checkpoint_prefixes(hf_config: Any) -> tuple[str, ...]:
        """The tensors the model reads (the loader skips ``mtp.*``, the MTP layers')."""
        return ("backbone.", "model.", "lm_head.")

    def make_layer(self, i: int) -> nn.Module:
        return NemotronHBlock(self.arch, self.arch.layer_types[i])

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        layer = self.layers[i]
        return x + self.mix(i, layer.norm(x), mixers)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (``backbone.`` as the Hub's, or ``model.``;
        others ignored); ``ValueError`` naming a missing tensor."""
        sd = CheckpointTensors({k.removeprefix("backbone.").removeprefix("model."): v
                          for k, v in sd.items()})  # fmt: skip
        self.init_buffers()
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["embeddings.weight"])
            self.norm.weight.copy_(sd["norm_f.weight"])
            self.lm_head.weight.copy_(sd["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                layer.norm.weight.copy_(sd[p + "norm.weight"])
                layer.mixer.load(sd, p + "mixer.")


class BambaLayer(nn.Module):
    def __init__(self, a: HybridArch, kind: str) -> None:
        super().__init__()
        self.mixer = Mamba2Mixer(a.mamba) if kind == MAMBA else HybridAttention(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.feed_forward = GatedMLP(a.hidden_size, a.intermediate_size, a.mlp_bias)


class BambaForCausalLM(_MambaHybridForCausalLM):
    """IBM Bamba (``bamba``; module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> HybridArch:
        return bamba_arch(hf_config)

    def make_layer(self, i: int) -> nn.Module:
        return BambaLayer(self.arch, self.arch.layer_types[i])

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        layer = self.layers[i]
        x = x + self.mix(i, layer.input_layernorm(x), mixers)
        return x + layer.feed_forward(layer.pre_ff_layernorm(x))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (``model.layers...``; others ignored), fusing
        the projections; ``ValueError`` naming a missing tensor."""
        sd = CheckpointTensors({k.removeprefix("model."): v for k, v in sd.items()})
        self.init_buffers()
        with torch.no_grad():
            self.load_ends(sd, "final_layernorm.weight")
            for i, (layer, kind) in enumerate(zip(self.layers, self.arch.layer_types, strict=True)):
                p = f"layers.{i}."
                layer.mixer.load(sd, p + ("mamba." if kind == MAMBA else "self_attn."))
                for norm in ("input_layernorm", "pre_ff_layernorm"):
                    getattr(layer, norm).weight.copy_(sd[f"{p}{norm}.weight"])
                self.load_feed_forward(layer.feed_forward, sd, p + "feed_forward.")

    def load_feed_forward(self, ff: nn.Module, sd: CheckpointTensors, prefix: str) -> None:
        """A layer's feed-forward from the checkpoint (a subclass's experts: Jamba's)."""
        ff.load(sd, prefix)


__all__ = [
    "HybridArch",
    "GraniteMoeHybridForCausalLM",
    "NemotronHForCausalLM",
    "BambaForCausalLM",
]
