"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``, transformers' ``mimo_v2_flash``) over a flat
packed batch.

The Llama layer (``llama.py``) with a mixture of experts (``moe.py``'s ``SparseMoeBlock``)
and MiMo's own attention, as transformers computes it:

- hybrid layers (``layer_types``): ``sliding_attention`` layers attend over a window of
  ``sliding_window`` positions (each token and the ``window - 1`` before it, HF's masks)
  with twice ``num_key_value_heads`` KV heads and a learned **sink** logit per query head
  (the ``sinks`` attention feature, gpt-oss's); ``full_attention`` layers attend over the
  whole context with ``num_key_value_heads`` heads and no sinks;
- q and k heads of ``head_dim`` (192), values of ``v_head_dim`` (128), values times
  ``attention_value_scale``; the softmax scale ``head_dim ** -0.5``;
- each layer type rotates by its own ``rope_parameters`` entry (theta), Neox-style, the
  first ``int(head_dim * partial_rotary_factor)`` dims (transformers' default factor
  0.334: 64 of 192);
- the feed-forward of the layers ``mlp_layer_types`` calls ``"sparse"`` is routed experts
  without a shared expert, by DeepSeek-V3's / GLM-4.5's routing (sigmoid scores plus
  ``e_score_correction_bias`` within the best ``topk_group`` of ``n_group`` groups,
  renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``; the router's
  logits in fp32 as transformers keeps it); the others a dense SiLU-gated MLP.

The KV cache holds one ``(num_kv_heads, head_dim)`` shape for every layer: the sliding
layers' KV head count and the q/k head size. A full-attention layer repeats each of its
KV heads (the query heads' grouping is unchanged), and every layer zero-pads its values
from ``v_head_dim`` to ``head_dim``: the backend's ``head_dim``-wide outputs then hold
the attention-weighted values in their first ``v_head_dim`` dims and zeros after, which
are sliced off before ``o_proj``. So each backend serves the model unchanged, at the cost
of V halves half again as wide as needed (192 for 128) and full layers caching their KV
heads twice (a sixth of the layers in the released model).

The checkpoint's multi-token-prediction layers (``model.mtp.*``) are not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.fused_moe import select_experts_grouped
from vllm.model_executor.layers.rotary_embedding import rope_parameters, rotary_dim
from vllm.model_executor.models.llama import LlamaArch, LlamaLayer, attention_features
from vllm.model_executor.models.moe import MoeArch, MoeForCausalLM, SparseMoeBlock

LAYER_KINDS = ("full_attention", "sliding_attention")
# transformers' partial_rotary_factor where a layer type's rope_parameters omit it.
DEFAULT_PARTIAL_ROTARY = 0.334


@dataclass(frozen=True)
class MiMoV2FlashArch(MoeArch):
    v_head_dim: int = 0
    value_scale: float = 1.0  # attention_value_scale: the values' multiplier
    full_kv_heads: int = 0  # a full-attention layer's KV heads (num_kv_heads: the sliding ones')

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_kv_heads if self.sliding_layers[layer] else self.full_kv_heads

    @classmethod
    def from_hf(cls, config: Any) -> MiMoV2FlashArch:
        n = config.num_hidden_layers
        types = list(getattr(config, "layer_types", None) or [])
        if len(types) != n or not set(types) <= set(LAYER_KINDS):
            raise ValueError(
                f"layer_types {types!r}: one of {LAYER_KINDS} for each of the {n} layers"
            )
        mlp_types = list(getattr(config, "mlp_layer_types", None) or [])
        if len(mlp_types) != n or not set(mlp_types) <= {"dense", "sparse"}:
            raise ValueError(
                f"mlp_layer_types {mlp_types!r}: one of 'dense' / 'sparse' for each of the "
                f"{n} layers"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        check_checkpoint_fields(config)
        ropes = mimo_rope_parameters(config)
        base = LlamaArch.from_hf(config)
        sliding = tuple(t == "sliding_attention" for t in types)
        kv = config.num_key_value_heads
        heads = config.num_attention_heads
        kv_heads = 2 * kv if any(sliding) else kv  # transformers: the sliding layers' twice
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads {heads} is not a multiple of the sliding layers' "
                f"KV heads (2 x num_key_value_heads {kv})"
            )
        if config.v_head_dim > config.head_dim:  # values are padded to the q/k head size
            raise ValueError(
                f"v_head_dim {config.v_head_dim} wider than head_dim {config.head_dim} is "
                "not supported for mimo_v2_flash"
            )
        experts = config.n_routed_experts
        groups, topk_groups = config.n_group or 1, config.topk_group or 1
        sparse = tuple(i for i, t in enumerate(mlp_types) if t == "sparse")
        if sparse and (experts % groups or not 1 <= topk_groups <= groups):
            raise ValueError(
                f"n_group {groups} / topk_group {topk_groups} do not divide "
                f"n_routed_experts {experts}"
            )
        if sparse and groups > 1 and experts // groups < 2:
            raise ValueError(f"n_group {groups}: groups of two or more of {experts} experts")
        v_scale = getattr(config, "attention_value_scale", None)
        fields = {
            **base.__dict__,
            "num_kv_heads": kv_heads,
            "rope_parameters": ropes["full_attention"],
            "rope_theta": ropes["full_attention"]["rope_theta"],
            "rope_local_parameters": ropes["sliding_attention"]
            if ropes["sliding_attention"] != ropes["full_attention"]
            else None,
            "sliding_layers": sliding,
        }
        return cls(
            **fields,
            num_experts=experts if sparse else 0,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=bool(config.norm_topk_prob),
            shared_expert_intermediate_size=0,
            sparse_layers=sparse,
            shared_expert_gated=False,
            scoring="sigmoid",
            num_groups=groups,
            topk_groups=topk_groups,
            routed_scaling_factor=float(config.routed_scaling_factor or 1.0),
            v_head_dim=config.v_head_dim,
            value_scale=1.0 if v_scale is None else float(v_scale),
            full_kv_heads=kv,
        )


def check_checkpoint_fields(config: Any) -> None:
    """The released config.json's own fields (its remote code's), which transformers does
    not read: ``ValueError`` naming one whose value differs from what transformers (and
    this model) computes."""
    kv = config.num_key_value_heads
    fixed = (
        ("swa_num_key_value_heads", 2 * kv, "the sliding layers' KV heads"),
        ("swa_head_dim", config.head_dim, "the sliding layers' q/k head size"),
        ("swa_v_head_dim", config.v_head_dim, "the sliding layers' value head size"),
        ("add_swa_attention_sink_bias", True, "the sliding layers' sinks"),
        ("add_full_attention_sink_bias", False, "the full layers' sinks"),
    )
    for field, served, what in fixed:
        value = getattr(config, field, None)
        if value is not None and value != served:
            raise ValueError(
                f"{field} {value!r} ({what}) is not supported for mimo_v2_flash (only "
                f"{served!r}, as transformers computes it)"
            )


def mimo_rope_parameters(config: Any) -> dict[str, dict[str, Any]]:
    """Each layer type's rotary parameters (``rope_parameters``' dict), as transformers
    computes them: ``rope_parameters`` keyed by layer type, the ``default`` type, the
    factor 0.334 where an entry omits it. ``ValueError`` naming the field otherwise."""
    raw = getattr(config, "rope_parameters", None) or {}
    out = {}
    for kind in LAYER_KINDS:
        entry = raw.get(kind)
        if not isinstance(entry, dict):
            raise ValueError(
                f"rope_parameters {raw!r}: MiMo-V2-Flash gives one entry per layer type "
                f"({', '.join(LAYER_KINDS)})"
            )
        params = rope_parameters(config, kind)
        if params["rope_type"] != "default":
            raise ValueError(
                f"rope_parameters[{kind!r}] rope_type {params['rope_type']!r} is not "
                "supported for mimo_v2_flash (only 'default')"
            )
        if entry.get("partial_rotary_factor") is None:
            params["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY
        if rotary_dim(config.head_dim, params) % 2:
            raise ValueError(
                f"rope_parameters[{kind!r}] partial_rotary_factor "
                f"{params['partial_rotary_factor']}: an odd number of rotated dims"
            )
        out[kind] = params
    return out


class MiMoV2FlashMoeBlock(SparseMoeBlock):
    """``SparseMoeBlock`` with GLM's sigmoid routing and no shared expert, the router's
    logits in fp32 (transformers keeps the router's weight in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = select_experts_grouped(
            logits, self.e_score_correction_bias, a.num_experts_per_tok, a.num_groups,
            a.topk_groups, a.norm_topk_prob, a.routed_scaling_factor,
        )  # fmt: skip
        return self.experts.apply(x, weights, ids)


class MiMoV2FlashLayer(LlamaLayer):
    """Llama's layer with MiMo's attention (module docstring): its own KV head count and
    value width; the cache's shapes made by repeating KV heads and padding values."""

    def __init__(self, a: MiMoV2FlashArch, layer: int, mlp: nn.Module | None) -> None:
        super().__init__(a, mlp)
        self.kv_heads = a.layer_kv_heads(layer)
        self.k_size = self.kv_heads * a.head_dim
        self.v_size = self.kv_heads * a.v_head_dim
        bias = a.attention_bias
        self.qkv_proj = nn.Linear(a.hidden_size, self.q_size + self.k_size + self.v_size, bias)
        self.o_proj = nn.Linear(a.num_heads * a.v_head_dim, a.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(a.num_heads)) if a.sliding_layers[layer] else None

    def _attention(self, positions, h, rope, meta, kv_cache) -> torch.Tensor:
        a = self.a
        q, k, v = self.qkv_proj(h).split([self.q_size, self.k_size, self.v_size], dim=-1)
        q, k = q.contiguous(), k.contiguous()
        rope(positions, q, k)  # in place
        k = k.view(-1, self.kv_heads, a.head_dim)
        v = v.reshape(-1, self.kv_heads, a.v_head_dim)
        if a.value_scale != 1.0:
            v = v * a.value_scale
        if self.kv_heads != a.num_kv_heads:  # a full layer: each head repeated
            repeat = a.num_kv_heads // self.kv_heads
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        v = F.pad(v, (0, a.head_dim - a.v_head_dim))  # the cache's head size
        out = self.attn_forward(q.view(-1, a.num_heads, a.head_dim), k, v, kv_cache, meta,
                                self.scale)  # fmt: skip
        return self.o_proj(out[..., : a.v_head_dim].reshape(-1, a.num_heads * a.v_head_dim))


class MiMoV2FlashForCausalLM(MoeForCausalLM):
    @staticmethod
    def arch_from_hf(hf_config: Any) -> MiMoV2FlashArch:
        return MiMoV2FlashArch.from_hf(hf_config)

    def __init__(self, arch: MiMoV2FlashArch) -> None:
        super().__init__(arch)
        self.layers = nn.ModuleList(
            MiMoV2FlashLayer(arch, i, self.make_mlp(i)) for i in range(arch.num_layers)
        )

    def make_mlp(self, layer: int) -> nn.Module | None:
        return MiMoV2FlashMoeBlock(self.arch) if layer in self.arch.sparse_layers else None

    @property
    def attention_features(self) -> frozenset[str]:
        sinks = {"sinks"} if any(self.arch.sliding_layers) else set()
        return attention_features(self.arch.sliding_windows) | sinks

    def layer_attention_features(self, layer: nn.Module) -> dict[str, Any]:
        return {} if layer.sinks is None else {"sinks": layer.sinks}

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Llama's load (q/k/v and gate/up fused, the experts by ``moe.py``), then the
        sliding layers' sinks (the checkpoint's ``attention_sink_bias``, transformers'
        ``sinks``). The ``mtp.`` tensors, and a full layer's sink where the checkpoint
        holds one, are not read (transformers reads neither)."""
        super().load_weights(sd)
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                if layer.sinks is not None:
                    p = f"layers.{i}.self_attn."
                    name = p + "sinks" if p + "sinks" in sd else p + "attention_sink_bias"
                    layer.sinks.copy_(sd[name])
