"""TII's Falcon-H1 (``FalconH1ForCausalLM``: tiiuae/Falcon-H1-0.5B/1.5B/7B-Instruct), as
transformers computes it. Every layer runs a Mamba2 mixer (``layers/mamba2.py``) and
attention side by side on the same normed input and adds both to the residual stream,
then a pre-norm SiLU-gated MLP: each layer has recurrent states and a KV cache (kind
``PARALLEL`` of ``mamba_hybrid.py``, whose loop over a step it shares).

Its muP multipliers, each where transformers applies it:

- ``embedding_multiplier``: the token embeddings (not ``inputs_embeds`` passed in);
- ``ssm_in_multiplier``: the Mamba2 mixer's input, before ``in_proj``;
  ``ssm_multipliers``: the projection's z, x, B, C and dt parts (transformers'
  ``mup_vector``, computed from the config: no checkpoint tensor); ``ssm_out_multiplier``:
  the mixer's output;
- ``attention_in_multiplier``: attention's input; ``key_multiplier``: k after its
  projection, folded into the attention scale (``q . (m k) = m (q . k)``, the rotation
  being linear); ``attention_out_multiplier``: attention's output;
- ``mlp_multipliers`` (gate, down): the gate projection before SiLU, the MLP's output;
- ``lm_head_multiplier``: the logits.

The mixer's width is ``mamba_d_ssm`` (else ``mamba_expand * hidden_size``); its gated
RMS norm exists only with ``mamba_rms_norm`` (the released checkpoints have none: ``y *
silu(z)``), in the order ``mamba_norm_before_gate`` says; ``in_proj`` has a bias with
``mamba_proj_bias``, ``out_proj`` with ``projectors_bias``. Attention heads are
``head_dim`` wide where the config gives one (narrower than ``hidden_size / heads`` in
some sizes); the rotation covers them whole for the ``default`` rope type (transformers'
Llama rotary ignores ``partial_rotary_factor`` there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.mamba2 import Mamba2Mixer
from vllm.model_executor.layers.rotary_embedding import max_positions, rope_parameters
from vllm.model_executor.models.hybrid_base import CheckpointTensors, StepMixers
from vllm.model_executor.models.llama import RMSNorm
from vllm.model_executor.models.mamba_hybrid import (
    PARALLEL,
    GatedMLP,
    HybridArch,
    HybridAttention,
    _heads,
    _layer_kinds,
    _MambaHybridForCausalLM,
    mamba_shape,
)


@dataclass(frozen=True)
class FalconH1Arch(HybridArch):
    """``HybridArch`` plus Falcon-H1's multipliers outside the mixers' own (1: none)."""

    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # (gate, down)
    lm_head_multiplier: float = 1.0


def falcon_h1_arch(config: Any) -> FalconH1Arch:
    """The arch of a ``falcon_h1`` config; ``ValueError`` for what this engine does not
    compute as transformers does."""
    if config.model_type != "falcon_h1":
        raise ValueError(f"model_type {config.model_type!r} is not falcon_h1")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    kinds = _layer_kinds(config.layers_block_type, (PARALLEL,), "layers_block_type")
    arch = _heads(config, kinds, getattr(config, "head_dim", None))
    rope = rope_parameters(config)
    if rope["rope_type"] == "default":  # transformers' Llama rotary: every dimension
        rope = {**rope, "partial_rotary_factor": 1.0}
    d_ssm = config.mamba_d_ssm or int(config.mamba_expand * config.hidden_size)
    if config.mamba_n_heads * config.mamba_d_head != d_ssm:
        raise ValueError(f"mamba_n_heads * mamba_d_head must be mamba_d_ssm ({d_ssm})")
    return FalconH1Arch(
        **arch,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=max_positions(config.max_position_embeddings, rope),
        tie_word_embeddings=bool(config.tie_word_embeddings),
        mamba=mamba_shape(
            config,
            norm_before_gate=bool(config.mamba_norm_before_gate),
            rms_norm=bool(config.mamba_rms_norm),
            out_proj_bias=bool(config.projectors_bias),
            in_multiplier=float(config.ssm_in_multiplier),
            zxbcdt_multipliers=tuple(float(m) for m in config.ssm_multipliers),
        ),
        attention_scale=float(config.key_multiplier) * arch["head_dim"] ** -0.5,
        rope=rope,
        attention_bias=bool(config.attention_bias),
        embedding_multiplier=float(config.embedding_multiplier),
        intermediate_size=config.intermediate_size,
        mlp_bias=bool(config.mlp_bias),
        attention_in_multiplier=float(config.attention_in_multiplier),
        attention_out_multiplier=float(config.attention_out_multiplier),
        ssm_out_multiplier=float(config.ssm_out_multiplier),
        mlp_multipliers=tuple(float(m) for m in config.mlp_multipliers),
        lm_head_multiplier=float(config.lm_head_multiplier),
    )


class FalconH1Layer(nn.Module):
    def __init__(self, a: FalconH1Arch) -> None:
        super().__init__()
        self.mamba = Mamba2Mixer(a.mamba)
        self.self_attn = HybridAttention(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.pre_ff_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.feed_forward = GatedMLP(a.hidden_size, a.intermediate_size, a.mlp_bias,
                                     a.mlp_multipliers)  # fmt: skip


class FalconH1ForCausalLM(_MambaHybridForCausalLM):
    """TII Falcon-H1 (``falcon_h1``; module docstring)."""

    arch: FalconH1Arch

    @staticmethod
    def arch_from_hf(hf_config: Any) -> FalconH1Arch:
        return falcon_h1_arch(hf_config)

    def make_layer(self, i: int) -> nn.Module:
        return FalconH1Layer(self.arch)

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        a, layer = self.arch, self.layers[i]
        h = layer.input_layernorm(x)
        ssm = mixers.recurrent(layer.mamba, self._state_index[i], h) * a.ssm_out_multiplier
        m = a.attention_in_multiplier
        attn = mixers.attention(layer.self_attn, self._kv_index[i], h * m if m != 1.0 else h)
        x = x + (ssm + attn * a.attention_out_multiplier)
        return x + layer.feed_forward(layer.pre_ff_layernorm(x))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float() * self.arch.lm_head_multiplier

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (``model.layers...``; others ignored), fusing
        the projections; ``ValueError`` naming a missing tensor."""
        sd = CheckpointTensors({k.removeprefix("model."): v for k, v in sd.items()})
        self.init_buffers()
        with torch.no_grad():
            self.load_ends(sd, "final_layernorm.weight")
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                layer.mamba.load(sd, p + "mamba.")
                layer.self_attn.load(sd, p + "self_attn.")
                for norm in ("input_layernorm", "pre_ff_layernorm"):
                    getattr(layer, norm).weight.copy_(sd[f"{p}{norm}.weight"])
                layer.feed_forward.load(sd, p + "feed_forward.")


__all__ = ["FalconH1ForCausalLM", "FalconH1Arch"]
