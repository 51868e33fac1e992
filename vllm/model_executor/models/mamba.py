"""The Mamba families, as transformers computes them: the pure state-space models Mamba
(``MambaForCausalLM``: state-spaces/mamba-*-hf), TII's FalconMamba
(``FalconMambaForCausalLM``: tiiuae/falcon-mamba-7b) and Mamba2
(``Mamba2ForCausalLM``: mistralai/Mamba-Codestral-7B-v0.1, state-spaces/mamba2-*), and
AI21's Jamba (``JambaForCausalLM``), which mixes Mamba1 layers with attention and
experts. Their mixers keep per-sequence states in the recurrent pools
(``layers/recurrent.py``): Mamba1's in ``layers/mamba1.py``, Mamba2's in
``layers/mamba2.py`` (Granite 4.0-H's and the other hybrids').

- **Mamba**, **FalconMamba** (``mamba``, ``falcon_mamba``): every layer is a pre-norm
  Mamba1 mixer added to the residual stream, which is kept in fp32 with
  ``residual_in_fp32`` (each norm reads it cast to the model's dtype; the final norm
  reads it in fp32). FalconMamba RMS-normalises the mixer's dt, B and C without weights
  (``mixer_rms_eps``). The output head is tied with ``tie_word_embeddings`` (Mamba's
  default).
- **Mamba2** (``mamba2``): the same frame around Mamba2 mixers: ``y`` gated by
  ``silu(z)`` before the gated RMS norm over ``n_groups`` groups (``layer_norm_epsilon``),
  dt clamped to ``time_step_limit``.
- **Jamba** (``jamba``): each layer a pre-norm Mamba1 mixer (weighted RMS norms on dt,
  B and C, ``rms_norm_eps``), or attention every ``attn_layer_period`` layers from
  ``attn_layer_offset`` (no rotation: positions come from the Mamba layers; scaled by
  ``head_dim ** -0.5``), then a pre-norm feed-forward: the SiLU-gated MLP, or every
  ``expert_layer_period`` layers from ``expert_layer_offset`` the routed experts (softmax
  over all, the top ``num_experts_per_tok`` weighted by their unnormalised
  probabilities).

The pure models have no attention layer: their arch's ``num_layers`` is 0, so the KV
cache has no tensor; the scheduler's blocks still track each sequence's tokens (prefix
caching's hashes, the recurrent checkpoints at block boundaries), costing no memory
(``model_runner.determine_num_blocks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.mamba1 import WEIGHTED, WEIGHTLESS, Mamba1Mixer, Mamba1Shape
from vllm.model_executor.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from vllm.model_executor.layers.recurrent import StateSpec
from vllm.model_executor.models.hybrid_base import (
    CheckpointTensors,
    HybridCausalLM,
    StepMixers,
)
from vllm.model_executor.models.mamba_hybrid import (
    ATTENTION,
    MAMBA,
    BambaForCausalLM,
    GatedMLP,
    HybridArch,
    HybridAttention,
    _heads,
    _layer_kinds,
)
from vllm.model_executor.models.moe import SparseMoeBlock


@dataclass(frozen=True)
class MambaArch:
    """A pure state-space model: ``num_layers`` (its attention layers: the KV cache's) 0;
    the head fields only give the attention backend a shape (nothing is cached)."""

    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # MAMBA each
    mixer: Mamba1Shape | Mamba2Shape
    residual_in_fp32: bool = True
    max_position_embeddings: int | None = None
    num_layers: int = 0
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    rope: None = None

    @property
    def num_mamba_layers(self) -> int:
        return len(self.layer_types)


def _refuse_act(config: Any) -> None:
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")


def mamba1_arch(config: Any) -> MambaArch:
    """The arch of a ``mamba`` or ``falcon_mamba`` config; ``ValueError`` for what this
    engine does not compute as transformers does. (``use_mambapy`` and
    ``use_associative_scan`` choose transformers' training paths: no change here.)"""
    if config.model_type not in ("mamba", "falcon_mamba"):
        raise ValueError(f"model_type {config.model_type!r} is not mamba or falcon_mamba")
    _refuse_act(config)
    falcon = config.model_type == "falcon_mamba"
    shape = Mamba1Shape(
        hidden_size=config.hidden_size,
        intermediate=config.intermediate_size,
        state_size=config.state_size,
        conv_kernel=config.conv_kernel,
        dt_rank=int(config.time_step_rank),
        proj_bias=bool(config.use_bias),
        conv_bias=bool(config.use_conv_bias),
        bcdt_norm=WEIGHTLESS if falcon else "none",
        bcdt_eps=float(getattr(config, "mixer_rms_eps", 1e-6)),
    )
    return _pure_arch(config, shape)


def mamba2_arch(config: Any) -> MambaArch:
    """The arch of a ``mamba2`` config; ``ValueError`` for what this engine does not
    compute as transformers does."""
    if config.model_type != "mamba2":
        raise ValueError(f"model_type {config.model_type!r} is not mamba2")
    _refuse_act(config)
    if config.num_heads * config.head_dim != int(config.expand * config.hidden_size):
        raise ValueError("num_heads * head_dim must be expand * hidden_size")
    low, high = getattr(config, "time_step_limit", None) or (0.0, math.inf)
    shape = Mamba2Shape(
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        n_groups=config.n_groups,
        state_size=config.state_size,
        conv_kernel=config.conv_kernel,
        chunk_size=config.chunk_size,
        rms_norm_eps=config.layer_norm_epsilon,
        dt_limit=(float(low), float(high)),
        proj_bias=bool(config.use_bias),
        conv_bias=bool(config.use_conv_bias),
    )
    return _pure_arch(config, shape)


def _pure_arch(config: Any, shape: Mamba1Shape | Mamba2Shape) -> MambaArch:
    return MambaArch(
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.layer_norm_epsilon,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        layer_types=(MAMBA,) * config.num_hidden_layers,
        mixer=shape,
        residual_in_fp32=bool(config.residual_in_fp32),
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
    )


class ResidualRMSNorm(nn.Module):
    """transformers' ``MambaRMSNorm``: the input normalised in fp32, times the weight, in
    the weight's dtype (the input may be the fp32 residual stream)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(self.weight.dtype)


class MambaBlock(nn.Module):
    def __init__(self, a: MambaArch) -> None:
        super().__init__()
        self.norm = ResidualRMSNorm(a.hidden_size, a.rms_norm_eps)
        mixer = Mamba1Mixer if isinstance(a.mixer, Mamba1Shape) else Mamba2Mixer
        self.mixer = mixer(a.mixer)


class _PureMambaForCausalLM(HybridCausalLM):
    """Mamba, FalconMamba and Mamba2 (module docstring): ``backbone.`` checkpoints."""

    arch: MambaArch
    norm_class = ResidualRMSNorm

    def make_layer(self, i: int) -> nn.Module:
        return MambaBlock(self.arch)

    def set_attention_backend(self, backend: Any) -> None:
        pass  # no attention layer

    def recurrent_state_specs(self, ssm_dtype: torch.dtype) -> list[tuple[StateSpec, ...]]:
        """Per layer: (its convolution's last inputs in the weights' dtype, its SSM state
        in ``ssm_dtype``)."""
        specs = self.arch.mixer.state_specs(self.embed_tokens.weight.dtype, ssm_dtype)
        return [specs] * len(self.arch.layer_types)

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        layer = self.layers[i]
        dtype = self.embed_tokens.weight.dtype
        out = mixers.recurrent(layer.mixer, i, layer.norm(x.to(dtype)))
        return (x.float() if self.arch.residual_in_fp32 else x) + out

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (``backbone.`` as the Hub's, the embeddings
        ``embeddings`` or the original checkpoints' ``embedding``); ``ValueError`` naming
        a missing tensor."""
        sd = CheckpointTensors({k.removeprefix("backbone."): v for k, v in sd.items()})
        if "embeddings.weight" not in sd and "embedding.weight" in sd:
            sd["embeddings.weight"] = sd["embedding.weight"]
        self.init_buffers()
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["embeddings.weight"])
            self.norm.weight.copy_(sd["norm_f.weight"])
            if not self.arch.tie_word_embeddings:
                self.lm_head.weight.copy_(sd["lm_head.weight"])
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                layer.norm.weight.copy_(sd[p + "norm.weight"])
                layer.mixer.load(sd, p + "mixer.")


class MambaForCausalLM(_PureMambaForCausalLM):
    """Mamba (``mamba``; module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> MambaArch:
        return mamba1_arch(hf_config)


class FalconMambaForCausalLM(_PureMambaForCausalLM):
    """TII FalconMamba (``falcon_mamba``; module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> MambaArch:
        return mamba1_arch(hf_config)


class Mamba2ForCausalLM(_PureMambaForCausalLM):
    """Mamba2 (``mamba2``; module docstring)."""

    @staticmethod
    def arch_from_hf(hf_config: Any) -> MambaArch:
        return mamba2_arch(hf_config)


@dataclass(frozen=True)
class JambaArch(HybridArch):
    """``HybridArch`` (its ``mamba`` a ``Mamba1Shape``) plus which layers have experts."""

    expert_layers: frozenset[int] = frozenset()


def jamba_arch(config: Any) -> JambaArch:
    """The arch of a ``jamba`` config; ``ValueError`` for what this engine does not compute
    as transformers does."""
    if config.model_type != "jamba":
        raise ValueError(f"model_type {config.model_type!r} is not jamba")
    _refuse_act(config)
    if getattr(config, "sliding_window", None):
        raise ValueError(f"sliding_window {config.sliding_window}: not supported for Jamba")
    kinds = _layer_kinds(config.layers_block_type, (MAMBA, ATTENTION), "layers_block_type")
    arch = _heads(config, kinds, None)
    dt_rank = config.mamba_dt_rank
    dt_rank = math.ceil(config.hidden_size / 16) if dt_rank == "auto" else int(dt_rank)
    experts = frozenset(i for i, n in enumerate(config.layers_num_experts) if n > 1)
    return JambaArch(
        **arch,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(config.tie_word_embeddings),
        mamba=Mamba1Shape(
            hidden_size=config.hidden_size,
            intermediate=int(config.mamba_expand * config.hidden_size),
            state_size=config.mamba_d_state,
            conv_kernel=config.mamba_d_conv,
            dt_rank=dt_rank,
            proj_bias=bool(config.mamba_proj_bias),
            conv_bias=bool(config.mamba_conv_bias),
            bcdt_norm=WEIGHTED,
            bcdt_eps=config.rms_norm_eps,
        ),
        attention_scale=arch["head_dim"] ** -0.5,
        intermediate_size=config.intermediate_size,
        num_experts=config.num_experts if experts else 0,
        num_experts_per_tok=config.num_experts_per_tok if experts else 0,
        moe_intermediate_size=config.intermediate_size if experts else 0,
        norm_topk_prob=False,
        expert_layers=experts,
    )


class JambaLayer(nn.Module):
    def __init__(self, a: JambaArch, i: int) -> None:
        super().__init__()
        kind = a.layer_types[i]
        self.mixer = Mamba1Mixer(a.mamba) if kind == MAMBA else HybridAttention(a)
        self.input_layernorm = ResidualRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.pre_ff_layernorm = ResidualRMSNorm(a.hidden_size, a.rms_norm_eps)
        if i in a.expert_layers:
            self.feed_forward = SparseMoeBlock(a)
        else:
            self.feed_forward = GatedMLP(a.hidden_size, a.intermediate_size, False)


class JambaForCausalLM(BambaForCausalLM):
    """AI21 Jamba (``jamba``; module docstring): Bamba's layer order, forward and
    checkpoint names, with Mamba1 mixers and experts."""

    arch: JambaArch
    norm_class = ResidualRMSNorm

    @staticmethod
    def arch_from_hf(hf_config: Any) -> JambaArch:
        return jamba_arch(hf_config)

    def make_layer(self, i: int) -> nn.Module:
        return JambaLayer(self.arch, i)

    def load_feed_forward(self, ff: nn.Module, sd: CheckpointTensors, prefix: str) -> None:
        """The MLP, or the experts one by one as the Hub's (``experts.E.gate_proj``...) or
        stacked as transformers 5's (``experts.gate_up_proj``, ``experts.down_proj``)."""
        if isinstance(ff, SparseMoeBlock):
            self._load_experts(ff, sd, prefix)
        else:
            ff.load(sd, prefix)

    def _load_experts(self, moe: SparseMoeBlock, sd: dict[str, torch.Tensor], p: str) -> None:
        moe.gate.weight.copy_(sd[p + "router.weight"])
        if p + "experts.gate_up_proj" in sd:
            moe.experts.w13.copy_(sd[p + "experts.gate_up_proj"])  # [gate; up] per expert
            moe.experts.w2.copy_(sd[p + "experts.down_proj"])
            return
        for e in range(self.arch.num_experts):
            gate, up, down = (sd[f"{p}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))
            moe.experts.load_expert(e, gate, up, down)


__all__ = [
    "MambaForCausalLM",
    "FalconMambaForCausalLM",
    "Mamba2ForCausalLM",
    "JambaForCausalLM",
]
