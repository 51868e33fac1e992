"""Mixture-of-experts models with Llama's attention: Mixtral, Qwen2-MoE (Qwen1.5-MoE),
Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B), OLMoE, Granite MoE, GLM-4.5,
MiniMax-M2 (M2, M2.1, M2.5: GLM's sigmoid routing ungrouped and unscaled, OLMo's q/k
norms over the whole projection, half of each head rotated) and ERNIE-4.5-MoE
(ERNIE-4.5-21B-A3B, -300B-A47B: ERNIE 4.5's attention, softmax scores chosen with a
correction bias, ``moe_statics``, as GLM's sigmoid ones, always renormalised, shared
experts ungated, dense layers outside ``moe_layer_start_index``..``end_index`` and its
``moe_layer_interval``); and the routings the mixtures with their own attention share
(DeepSeek-V2's ``select_experts_group_limited``, used by ``deepseek_v2.py`` beside
``fused_moe.select_experts_grouped``).

A layer is ``LlamaLayer``'s attention (Qwen2's q/k/v biases, Qwen3's q/k norms as in
``llama.py``) with a ``SparseMoeBlock`` for the feed-forward: a router (``gate``), the
routed experts (``layers/fused_moe.py``) and, for Qwen2-MoE, a shared expert scaled by a
sigmoid gate. Qwen's ``decoder_sparse_step`` and ``mlp_only_layers`` keep some layers
dense. Registered for the three HF architectures in ``registry.py``; Qwen3-VL-MoE's
language model is Qwen3-MoE's (``qwen3_vl_moe.py``), its experts stored stacked.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts_grouped
from vllm.model_executor.models.llama import LlamaArch, LlamaForCausalLM


@dataclass(frozen=True)
class MoeArch(LlamaArch):
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    sparse_layers: tuple[int, ...] = ()  # layers whose feed-forward is the experts
    checkpoint_prefix: str = "mlp"  # the block's name in the checkpoint (Mixtral's differs)
    # Qwen2-MoE gates its shared expert by a sigmoid (``shared_expert_gate``); GLM-4.5 does
    # not, and names it ``shared_experts``.
    shared_expert_gated: bool = True
    # GLM-4.5's routing (fused_moe.select_experts_grouped): sigmoid scores plus a learned
    # correction bias, chosen within the best groups, scaled; "softmax": the others';
    # "softmax_biased": ERNIE-4.5-MoE's, softmax scores chosen as GLM's by score plus bias.
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # Whether the checkpoint holds the sigmoid routing's correction bias (MiniMax-M2's
    # ``use_routing_bias``); without it the bias is 0, as transformers initialises it.
    routing_bias: bool = True

    @classmethod
    def from_hf(cls, config) -> MoeArch:
        base = LlamaArch.from_hf(config)
        glm: dict = {}
        if config.model_type == "mixtral":
            num_experts, intermediate = config.num_local_experts, config.intermediate_size
            sparse = tuple(range(base.num_layers))
            norm, shared, prefix = True, 0, "block_sparse_moe"
        elif config.model_type == "glm4_moe":
            num_experts, intermediate = config.n_routed_experts, config.moe_intermediate_size
            first_sparse = config.first_k_dense_replace
            sparse = tuple(range(first_sparse, base.num_layers))
            norm, prefix = bool(config.norm_topk_prob), "mlp"
            shared = config.moe_intermediate_size * config.n_shared_experts
            glm = dict(shared_expert_gated=False, scoring="sigmoid", num_groups=config.n_group,
                       topk_groups=config.topk_group,
                       routed_scaling_factor=config.routed_scaling_factor)  # fmt: skip
        elif config.model_type == "minimax_m2":  # Mixtral's names, GLM's routing, 1 group
            num_experts, intermediate = config.num_local_experts, config.intermediate_size
            sparse = tuple(range(base.num_layers))
            norm, shared, prefix = True, 0, "block_sparse_moe"
            glm = dict(scoring="sigmoid",
                       routing_bias=bool(getattr(config, "use_routing_bias", True)))  # fmt: skip
            base = minimax_m2_attention(config, base)
        elif config.model_type == "granitemoe":  # Granite's scalars, Mixtral's routing
            num_experts, intermediate = config.num_local_experts, config.intermediate_size
            sparse = tuple(range(base.num_layers))
            norm, shared, prefix = True, 0, "block_sparse_moe"
        elif config.model_type == "ernie4_5_moe":
            num_experts, intermediate = config.moe_num_experts, config.moe_intermediate_size
            sparse = ernie_sparse_layers(config, base.num_layers)
            norm, prefix = True, "mlp"  # renormalised always (moe_norm_min: a mere floor)
            shared = config.moe_intermediate_size * (config.moe_num_shared_experts or 0)
            glm = dict(shared_expert_gated=False, scoring="softmax_biased")
        elif config.model_type == "olmoe":
            num_experts, intermediate = config.num_experts, config.intermediate_size
            sparse = tuple(range(base.num_layers))
            norm, shared, prefix = bool(config.norm_topk_prob), 0, "mlp"
        else:  # qwen2_moe, qwen3_moe
            num_experts, intermediate = config.num_experts, config.moe_intermediate_size
            step = getattr(config, "decoder_sparse_step", 1) or 1
            dense = set(getattr(config, "mlp_only_layers", None) or ())
            sparse = tuple(
                i
                for i in range(base.num_layers)
                if i not in dense and num_experts > 0 and (i + 1) % step == 0
            )
            norm = bool(getattr(config, "norm_topk_prob", False))
            shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
            prefix = "mlp"
        activation = getattr(config, "hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"hidden_act {activation!r} is not supported (only 'silu')")
        return cls(
            **base.__dict__,
            num_experts=num_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=intermediate,
            norm_topk_prob=norm,
            shared_expert_intermediate_size=shared,
            sparse_layers=sparse,
            checkpoint_prefix=prefix,
            **glm,
        )


def ernie_sparse_layers(config: Any, num_layers: int) -> tuple[int, ...]:
    """ERNIE-4.5-MoE's layers whose feed-forward is the experts, as transformers places
    them: from ``moe_layer_start_index`` to ``moe_layer_end_index`` (inclusive; -1: the
    last layer), those whose number counted from 1 is a multiple of ``moe_layer_interval``;
    none without experts."""
    if not (config.moe_num_experts or 0):
        return ()
    start = config.moe_layer_start_index
    end = config.moe_layer_end_index
    end = num_layers - 1 if end is None or end == -1 else end
    interval = config.moe_layer_interval or 1
    return tuple(i for i in range(start, min(end, num_layers - 1) + 1) if (i + 1) % interval == 0)


# MiniMax-M2's config fields that transformers does not read (the released checkpoints'
# remote code does): the value transformers computes as, and what another value would be.
_MINIMAX_M2_FIXED = (
    ("use_qk_norm", True, "q and k not normalised"),
    ("qk_norm_type", "per_layer", "q and k normalised otherwise than over the whole projection"),
    ("scoring_func", "sigmoid", "another router score"),
    ("shared_intermediate_size", 0, "shared experts"),
)


def minimax_m2_attention(config: Any, base: LlamaArch) -> LlamaArch:
    """MiniMax-M2's attention, as transformers computes it: q and k RMS-normalised over the
    whole projection (widths heads * head_dim and kv_heads * head_dim, one weight per
    element: ``qk_norm_type`` "per_layer"), every layer over the whole context (a
    ``sliding_window`` is not read). ``ValueError`` naming the config field of a checkpoint
    that would be computed otherwise: ``_MINIMAX_M2_FIXED``, or linear-attention layers
    (MiniMax-01's lightning attention: 0 in ``attn_type_list``)."""
    for field, served, other in _MINIMAX_M2_FIXED:
        value = getattr(config, field, None)
        if value is not None and value != served:
            raise ValueError(
                f"{field} {value!r} ({other}) is not supported for MiniMax-M2 "
                f"(only {served!r}, as transformers computes it)"
            )
    kinds = getattr(config, "attn_type_list", None) or ()
    if any(kind != 1 for kind in kinds):
        raise ValueError(
            f"attn_type_list {list(kinds)}: linear-attention layers (0) are not supported "
            "for MiniMax-M2 (only full attention, 1)"
        )
    return replace(base, qk_norm=False, qk_norm_full=True, sliding_windows=())


def select_experts_group_limited(
    router_logits: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's routing (``topk_method`` greedy, or group_limited_greedy when
    ``num_groups > 1``): softmax over all experts in fp32; grouped, only the experts of the
    ``topk_groups`` groups (of ``num_groups``) whose best expert scores highest compete.
    The ``top_k`` largest probabilities weight their experts (divided by their sum when
    ``renormalize``), times ``scaling``. (weights fp32, ids int64), ``(num_tokens, top_k)``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    choice = probs
    if num_groups > 1:
        grouped = probs.view(probs.shape[0], num_groups, -1)
        best_groups = grouped.amax(dim=-1).topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        choice = probs.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
    weights, ids = choice.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class SparseMoeBlock(nn.Module):
    """``(num_tokens, hidden) -> (num_tokens, hidden)``: the routed experts' weighted sum,
    plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` where there is one (without
    the gate for GLM-4.5's and ERNIE-4.5-MoE's)."""

    def __init__(self, a: MoeArch) -> None:
        super().__init__()
        self.a = a
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)  # the router
        if a.scoring != "softmax":  # GLM's, MiniMax-M2's, ERNIE's correction bias
            self.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_experts))
        self.experts = FusedMoE(
            a.num_experts,
            a.num_experts_per_tok,
            a.hidden_size,
            a.moe_intermediate_size,
            renormalize=a.norm_topk_prob,
        )
        self.shared = a.shared_expert_intermediate_size > 0
        if self.shared:
            width = a.shared_expert_intermediate_size
            self.shared_gate_up_proj = nn.Linear(a.hidden_size, 2 * width, bias=False)
            self.shared_down_proj = nn.Linear(width, a.hidden_size, bias=False)
            if a.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        if a.scoring != "softmax":
            scores = "sigmoid" if a.scoring == "sigmoid" else "softmax"
            out = self.experts.apply(x, *select_experts_grouped(
                self.gate(x), self.e_score_correction_bias, a.num_experts_per_tok, a.num_groups,
                a.topk_groups, a.norm_topk_prob, a.routed_scaling_factor, scores,
            ))  # fmt: skip
        else:
            out = self.experts(x, self.gate(x))
        if self.shared:
            shared = self.shared_down_proj(ops.silu_and_mul(self.shared_gate_up_proj(x)))
            if a.shared_expert_gated:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


class MoeForCausalLM(LlamaForCausalLM):
    gguf_layout: ClassVar[Any] = None  # --quantization gguf: refused with its reason

    @staticmethod
    def arch_from_hf(hf_config: Any) -> MoeArch:
        return MoeArch.from_hf(hf_config)

    def make_mlp(self, layer: int) -> nn.Module | None:
        return SparseMoeBlock(self.arch) if layer in self.arch.sparse_layers else None

    def load_mlp(self, mlp: nn.Module, sd: dict[str, torch.Tensor], prefix: str) -> None:
        load_moe_block(self.arch, mlp, sd, prefix)


def load_moe_block(a: MoeArch, mlp: nn.Module, sd: dict[str, torch.Tensor], prefix: str) -> None:
    """Fill a ``SparseMoeBlock`` of arch ``a`` from the checkpoint tensors of the layer
    ``prefix`` (``layers.N.``)."""
    p = f"{prefix}{a.checkpoint_prefix}."
    if p + "input_linear.weight" in sd:  # Granite MoE: the experts stacked already
        mlp.gate.weight.copy_(sd[p + "router.layer.weight"])
        mlp.experts.w13.copy_(sd[p + "input_linear.weight"])  # [gate; up] per expert
        mlp.experts.w2.copy_(sd[p + "output_linear.weight"])
        return
    if p + "gate.weight" not in sd:  # transformers 5's own names (Mixtral's, MiniMax-M2's)
        p = f"{prefix}mlp."
    mlp.gate.weight.copy_(sd[p + "gate.weight"])
    for e, (gate, up, down) in enumerate(expert_weights(a, sd, p)):
        mlp.experts.load_expert(e, gate, up, down)
    if a.scoring != "softmax":  # GLM's name, MiniMax-M2's, ERNIE's (Hub's, transformers')
        names = (p + "gate.e_score_correction_bias", p + "e_score_correction_bias",
                 p + "moe_statics.e_score_correction_bias",
                 p + "gate.moe_statics.e_score_correction_bias")  # fmt: skip
        name = next((n for n in names if n in sd), names[0])
        if name in sd or a.routing_bias:  # ERNIE's (1, experts): one group
            mlp.e_score_correction_bias.copy_(sd[name].reshape(-1))
        else:
            mlp.e_score_correction_bias.zero_()
    if mlp.shared:
        s = p + ("shared_expert." if a.shared_expert_gated else "shared_experts.")
        mlp.shared_gate_up_proj.weight.copy_(
            torch.cat([sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]])
        )
        mlp.shared_down_proj.weight.copy_(sd[s + "down_proj.weight"])
        if a.shared_expert_gated:
            mlp.shared_expert_gate.weight.copy_(sd[p + "shared_expert_gate.weight"])


def expert_weights(
    a: MoeArch, sd: dict[str, torch.Tensor], p: str
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each routed expert's (gate (I, H), up (I, H), down (H, I)) weights from the checkpoint
    tensors of the block ``p`` (``layers.N.mlp.``): one tensor each (``experts.N.gate_proj``,
    Mixtral's and MiniMax-M2's ``w1`` / ``w3`` / ``w2``), or all experts stacked in
    ``experts.gate_up_proj`` and ``experts.down_proj`` (``stacked_experts``)."""
    i = a.moe_intermediate_size
    if p + "experts.gate_up_proj" in sd:
        gate_up = stacked_experts(
            sd, p + "experts.gate_up_proj", (a.num_experts, 2 * i, a.hidden_size)
        )
        down = stacked_experts(sd, p + "experts.down_proj", (a.num_experts, a.hidden_size, i))
        for e in range(a.num_experts):
            yield gate_up[e, :i], gate_up[e, i:], down[e]
        return
    names = ("w1", "w3", "w2") if a.checkpoint_prefix == "block_sparse_moe" else (
        "gate_proj", "up_proj", "down_proj"
    )  # fmt: skip
    for e in range(a.num_experts):
        gate, up, down = (sd[f"{p}experts.{e}.{n}.weight"] for n in names)
        yield gate, up, down


def stacked_experts(
    sd: dict[str, torch.Tensor], name: str, shape: tuple[int, int, int]
) -> torch.Tensor:
    """The checkpoint's stacked experts ``name`` as (experts, out, in) ``shape``: transformers
    5's layout (what its ``save_pretrained`` writes: ``gate_up_proj`` (E, [gate; up], H),
    ``down_proj`` (E, H, I)), or transformers 4's, each expert transposed ((E, H, 2I) and
    (E, I, H): Qwen3-VL-MoE's Hub checkpoints), as a view. As transformers' loader, a
    tensor already of ``shape`` is taken as it is (so where H is 2I or I, the layout
    cannot be told from the shape alone: transformers 5's). ``ValueError`` for another
    shape."""
    tensor = sd[name]
    if tensor.shape == shape:
        return tensor
    if tensor.shape == (shape[0], shape[2], shape[1]):
        return tensor.transpose(1, 2)
    raise ValueError(
        f"{name} of shape {tuple(tensor.shape)}: experts stacked as {shape} or transposed "
        f"{(shape[0], shape[2], shape[1])}"
    )
