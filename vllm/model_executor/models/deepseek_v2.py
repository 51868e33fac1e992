"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``:
DeepSeek-V2/V2-Lite, DeepSeek-V3/R1, Moonlight, Kimi-K2) and Mistral 4
(``Mistral4ForCausalLM``: Mistral Small 4's language model) and GLM-4.7-Flash
(``Glm4MoeLiteForCausalLM``) over a flat packed batch.

**Multi-head latent attention (MLA), cached as the latent.** Each token's K and V are one
shared latent ``c_kv`` (``kv_lora_rank`` wide, RMS-normalised) plus one rotated key part
``k_pe`` (``qk_rope_head_dim``) shared by all heads; a head's key and value are ``c_kv``
through its slices of ``kv_b_proj`` (``W_UK``, ``W_UV``). As vLLM does, the cache keeps
the latent, not the expanded heads, and the heads' matrices are absorbed into the query
and the output, so attention runs as multi-query attention over the latent (one KV head
of ``kv_lora_rank + qk_rope_head_dim`` = 576 dims):

- key   ``[c_kv | rotated k_pe]``, the only thing cached: one row per token per layer;
- value ``c_kv``: the key's first ``kv_lora_rank`` dims, read from the cached key (the
  arch's ``latent_value_size``; the backend's latent cache, ``backends/abstract.py``);
- query of head h ``[q_nope_h @ W_UK_h | rotated q_pe_h]`` (so ``q . k`` is the head's
  ``q_nope . k_nope + q_pe . k_pe``);
- the backend's ``kv_lora_rank``-wide output of head h, through ``W_UV_h``, gives the
  head's ``v_head_dim`` output; heads concatenated, then ``o_proj``.

The cache is ``(1, blocks, block_size, 1, 576)`` per layer: 576 values a token a layer, as
vLLM's (before, a V half held ``c_kv`` again plus 64 zeros: twice that), far below the
expanded heads (V3: 128 heads x (192 + 128)). On CUDA the ``TRITON_MLA`` backend attends:
its Triton decode kernel (``triton_mla_decode``) reads the latent rows in place and can be
captured in CUDA graphs; prefill chunks take SDPA over gathered rows. On CPU, TORCH_SDPA.
The softmax scale is ``qk_head_dim ** -0.5``, times yarn's
``mscale(factor, mscale_all_dim) ** 2`` where the rotary scaling names ``mscale_all_dim``.
The rotation pairs adjacent dimensions (V2 always; V3 with ``rope_interleave``).

**Mixture of experts.** Layers from ``first_k_dense_replace`` on (every
``moe_layer_freq``-th) route each token to ``num_experts_per_tok`` of ``n_routed_experts``
experts and add ``n_shared_experts`` always-on experts (one dense MLP); the others are
dense. Routing: ``greedy`` / ``group_limited_greedy`` (softmax scores, V2:
``moe.select_experts_group_limited``) or ``noaux_tc`` (sigmoid scores plus
``e_score_correction_bias`` within the best groups, V3: ``select_experts_grouped``),
renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``. (transformers'
DeepSeek-V2 port ignores ``norm_topk_prob``; we apply it, as DeepSeek's own code and vLLM
do; the released V2 configs set it false.)

**Mistral 4** (transformers' ``mistral4``) is this model with three differences, read from
its config by ``DeepseekV2Arch.from_hf``: its router scores by softmax and keeps the
``topk_group`` groups (of ``n_group``) whose two best scores sum highest (V3's group rank
without a bias: ``select_experts_grouped``), its router's logits in the model's dtype, as
transformers computes them; its queries (all of each head's dims) grow with the position,
times ``1 + llama_4_scaling_beta * log(1 + floor(pos / original_max_position_embeddings))``
(``rope_parameters``' fields; Llama 4's scale), applied per token to the absorbed query, so
in every path that attends (prefill, decode, CUDA graphs: the positions are a tensor);
and its ``head_dim`` is the whole q/k head, the rotated part ``partial_rotary_factor`` of
it (``qk_rope_head_dim``).

**GLM-4.7-Flash** (``Glm4MoeLiteForCausalLM``, transformers' ``glm4_moe_lite``) is V3's
model: the same latent attention (q through ``q_lora_rank``, pairs interleaved by
``rope_interleave``, yarn's scale), GLM-4.5's router (V3's ``noaux_tc`` sigmoid routing,
whatever ``topk_method`` says: transformers reads none), shared experts, its MoE layers
those ``mlp_layer_types`` calls ``"sparse"`` (``first_k_dense_replace`` unread).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vllm import _custom_ops as ops
from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts_grouped
from vllm.model_executor.layers.quantization.fp8_checkpoint import FP8_METHODS
from vllm.model_executor.layers.rotary_embedding import (
    max_positions,
    rope_parameters,
    rotary_dim,
)
from vllm.model_executor.models.llama import (
    RMSNorm,
    RotaryEmbedding,
    layer_attention,
    load_embeddings_and_head,
)
from vllm.model_executor.models.moe import select_experts_group_limited, stacked_experts

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default epsilon,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# (topk_method, scoring_func) pairs the routing computes.
ROUTINGS = (("greedy", "softmax"), ("group_limited_greedy", "softmax"), ("noaux_tc", "sigmoid"))
# Mistral 4's routing (not a DeepSeek config's topk_method): softmax scores, the groups
# ranked by their two best scores.
SOFTMAX_TOP2_GROUPS = "softmax_top2_groups"


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def is_sparse_layer(config: Any, i: int) -> bool:
    """Whether layer ``i``'s feed-forward is the routed experts: from
    ``first_k_dense_replace`` on, every ``moe_layer_freq``-th (V3's multi-token-prediction
    layer, index ``num_hidden_layers``, by the same rule)."""
    num_experts = getattr(config, "n_routed_experts", None) or 0
    freq = getattr(config, "moe_layer_freq", 1) or 1
    first_sparse = getattr(config, "first_k_dense_replace", 0) or 0
    return bool(num_experts) and i >= first_sparse and i % freq == 0


@dataclass(frozen=True)
class DeepseekV2Arch:
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    intermediate_size: int  # the dense layers' MLP
    rms_norm_eps: float
    max_position_embeddings: int  # the rotary table's length
    tie_word_embeddings: bool
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool  # q_a_proj's, kv_a_proj_with_mqa's and o_proj's
    rope_parameters: dict[str, Any]
    rope_interleave: bool  # adjacent dimensions paired (GPT-J style); else Neox halves
    softmax_scale: float
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    sparse_layers: tuple[int, ...] = ()  # layers whose feed-forward is the experts
    topk_method: str = "greedy"  # greedy, group_limited_greedy, noaux_tc (ROUTINGS)
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    router_fp32: bool = True  # the router's logits in fp32 (DeepSeek), else the model's dtype
    # Llama 4's query scale by position (Mistral 4): 1 + beta * log(1 + floor(pos / original));
    # beta 0: none.
    query_scale_beta: float = 0.0
    query_scale_original: int = 1
    # The KV cache: one latent "head" per token (see the module docstring).
    num_kv_heads: int = 1

    @property
    def head_dim(self) -> int:
        """The cache's and the backend's head size: the latent plus the rotated key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def latent_value_size(self) -> int:
        """Values are the cached keys' first ``kv_lora_rank`` dims (``c_kv``): the cache
        holds keys only (the runner's ``kv_cache_shape``, the ``latent_kv`` feature)."""
        return self.kv_lora_rank

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, config) -> DeepseekV2Arch:
        # DeepSeek-V3.2 and GLM-5 (models/deepseek_dsa.py) route and rotate as V3, and so
        # does GLM-4.7-Flash (glm4_moe_lite).
        glm_lite = config.model_type == "glm4_moe_lite"
        v3 = config.model_type in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite")
        mistral4 = config.model_type == "mistral4"
        quant = getattr(config, "quantization_config", None)
        method = (
            (quant.get("quant_method") if isinstance(quant, dict) else quant) if quant else None
        )
        if method is not None and method not in FP8_METHODS:  # FP8: the loader reads them
            raise ValueError(
                f"quantization_config ({method!r}) is not supported for {config.model_type}: "
                f"serve a checkpoint in bf16/fp16/fp32 or FP8 ({', '.join(FP8_METHODS)})"
            )
        for field, ok in (("hidden_act", "silu"), ("mlp_bias", False)):
            if getattr(config, field, ok) != ok:
                raise ValueError(f"{field} {getattr(config, field)!r} is not supported ({ok!r})")
        rope = mistral4_rope(config) if mistral4 else rope_parameters(config)
        if glm_lite and rotary_dim(config.qk_rope_head_dim, rope) != config.qk_rope_head_dim:
            raise ValueError(
                f"rope_parameters partial_rotary_factor {rope['partial_rotary_factor']}: "
                f"glm4_moe_lite rotates all qk_rope_head_dim {config.qk_rope_head_dim} dims"
            )
        qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        scale = qk_head_dim**-0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        n_layers = config.num_hidden_layers
        if mistral4:  # transformers: every layer from first_k_dense_replace on
            sparse = tuple(range(getattr(config, "first_k_dense_replace", 0) or 0, n_layers))
        elif glm_lite:  # transformers: mlp_layer_types alone (first_k_dense_replace unread)
            sparse = glm_lite_sparse_layers(config)
        else:
            sparse = tuple(i for i in range(n_layers) if is_sparse_layer(config, i))
        return cls(
            hidden_size=config.hidden_size,
            num_layers=n_layers,
            num_heads=config.num_attention_heads,
            vocab_size=config.vocab_size,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=max_positions(config.max_position_embeddings, rope),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            q_lora_rank=config.q_lora_rank,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            rope_parameters=rope,
            rope_interleave=bool(getattr(config, "rope_interleave", True))
            if v3 or mistral4
            else True,
            softmax_scale=scale,
            sparse_layers=sparse,
            **(cls.experts_from_hf(config, v3, glm_lite) if sparse and not mistral4 else {}),
            **(mistral4_fields(config, rope, bool(sparse)) if mistral4 else {}),
        )

    @staticmethod
    def experts_from_hf(config, v3: bool, glm_lite: bool = False) -> dict[str, Any]:
        method = getattr(config, "topk_method", None) or ("noaux_tc" if v3 else "greedy")
        scoring = getattr(config, "scoring_func", None) or ("sigmoid" if v3 else "softmax")
        if glm_lite:  # GLM-4.5's router (transformers reads neither field): V3's always
            method, scoring = "noaux_tc", "sigmoid"
        if (method, scoring) not in ROUTINGS:
            raise ValueError(
                f"topk_method {method!r} with scoring_func {scoring!r} is not supported "
                f"(supported: {', '.join(f'{m} with {s}' for m, s in ROUTINGS)})"
            )
        groups = getattr(config, "n_group", None) or 1
        topk_groups = getattr(config, "topk_group", None) or 1
        if method == "greedy":  # the groups play no part
            groups = topk_groups = 1
        if config.n_routed_experts % groups or not 1 <= topk_groups <= groups:
            raise ValueError(
                f"n_group {groups} / topk_group {topk_groups} do not divide "
                f"n_routed_experts {config.n_routed_experts}"
            )
        return dict(
            num_experts=config.n_routed_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.moe_intermediate_size,
            n_shared_experts=getattr(config, "n_shared_experts", None) or 0,
            topk_method=method,
            num_groups=groups,
            topk_groups=topk_groups,
            norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)),
            routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        )


def glm_lite_sparse_layers(config: Any) -> tuple[int, ...]:
    """GLM-4.7-Flash's layers whose feed-forward is the experts: its ``mlp_layer_types``
    (``"dense"`` / ``"sparse"`` a layer; transformers' default the first dense, the rest
    sparse)."""
    n_layers = config.num_hidden_layers
    types = getattr(config, "mlp_layer_types", None) or ["dense"] + ["sparse"] * (n_layers - 1)
    if len(types) != n_layers or not set(types) <= {"dense", "sparse"}:
        raise ValueError(
            f"mlp_layer_types {types!r}: one of 'dense' / 'sparse' for each of the "
            f"{n_layers} layers"
        )
    return tuple(i for i, t in enumerate(types) if t == "sparse")


def mistral4_rope(config: Any) -> dict[str, Any]:
    """Mistral 4's rotary parameters, over its ``qk_rope_head_dim`` dims whole: transformers
    computes frequencies for ``int(head_dim * partial_rotary_factor)`` dims (its
    ``head_dim`` the whole q/k head; for the ``default`` type all of ``head_dim``), which
    must be that part."""
    rope = rope_parameters(config)
    head_dim = getattr(config, "head_dim", None) or (
        config.qk_nope_head_dim + config.qk_rope_head_dim
    )
    default = rope["rope_type"] == "default"
    rotated = head_dim if default else rotary_dim(head_dim, rope)
    if rotated != config.qk_rope_head_dim:
        raise ValueError(
            f"rope_parameters rope_type {rope['rope_type']!r}, partial_rotary_factor "
            f"{rope['partial_rotary_factor']}: transformers rotates {rotated} dims of head_dim "
            f"{head_dim}, not qk_rope_head_dim {config.qk_rope_head_dim}"
        )
    return {**rope, "partial_rotary_factor": 1.0}


def mistral4_fields(config: Any, rope: dict[str, Any], sparse: bool) -> dict[str, Any]:
    """Mistral 4's arch fields beyond DeepSeek's: its query scale and (``sparse``) its
    experts and routing. ``ValueError`` naming the field for what transformers' code does
    not run."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads != heads:
        raise ValueError(
            f"num_key_value_heads {kv_heads}: latent attention expands one key per head "
            f"(num_attention_heads {heads})"
        )
    beta, original = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")
    if not isinstance(beta, (int, float)) or not isinstance(original, int) or original < 1:
        raise ValueError(
            f"rope_parameters llama_4_scaling_beta {beta!r} and original_max_position_embeddings "
            f"{original!r}: Mistral 4 scales its queries by both (a number, a positive length)"
        )
    fields: dict[str, Any] = dict(query_scale_beta=float(beta), query_scale_original=original)
    if not sparse:
        return fields
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    groups, topk_groups = config.n_group or 1, config.topk_group or 1
    if experts % groups or not 1 <= topk_groups <= groups or experts // groups < 2:
        raise ValueError(
            f"n_group {groups} / topk_group {topk_groups}: groups of two or more of the "
            f"n_routed_experts {experts} (a group ranks by its two best), topk_group of them"
        )
    if not 1 <= top_k <= topk_groups * (experts // groups):
        raise ValueError(
            f"num_experts_per_tok {top_k}: 1 to the {topk_groups * (experts // groups)} "
            f"experts of the topk_group {topk_groups} groups kept"
        )
    return fields | dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=config.moe_intermediate_size,
        n_shared_experts=getattr(config, "n_shared_experts", None) or 0,
        topk_method=SOFTMAX_TOP2_GROUPS,
        num_groups=groups,
        topk_groups=topk_groups,
        norm_topk_prob=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor),
        router_fp32=False,
    )


def llama4_query_scale(positions: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """(num_tokens,) positions -> (num_tokens,) fp32 ``1 + beta * log(1 + floor(pos /
    original))``, as transformers computes it (fp32 division of the integer positions)."""
    return 1 + beta * torch.log(1 + torch.floor(positions / original))


def deepseek_rope(a: DeepseekV2Arch) -> RotaryEmbedding:
    """The rotary embedding of the keys' and queries' ``qk_rope_head_dim`` part (fp32 on
    the CPU; ``init_buffers`` moves it)."""
    return RotaryEmbedding(
        a.qk_rope_head_dim, a.max_position_embeddings, a.rope_parameters,
        neox=not a.rope_interleave,
    )  # fmt: skip


class DenseMLP(nn.Module):
    """SiLU-gated MLP with fused gate/up: the dense layers' and the shared experts'."""

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))

    @torch.no_grad()
    def load(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        gate_up = [sd[f"{prefix}{n}_proj.weight"] for n in ("gate", "up")]
        self.gate_up_proj.weight.copy_(torch.cat(gate_up))
        self.down_proj.weight.copy_(sd[prefix + "down_proj.weight"])


class DeepseekMoE(nn.Module):
    """``(num_tokens, hidden) -> (num_tokens, hidden)``: the routed experts' weighted sum
    plus the shared experts' output."""

    def __init__(self, a: DeepseekV2Arch) -> None:
        super().__init__()
        self.a = a
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=False)  # the router
        if a.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_experts))
        self.experts = FusedMoE(
            a.num_experts, a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size,
            renormalize=a.norm_topk_prob,
        )  # fmt: skip
        self.shared_experts = None
        if a.n_shared_experts:
            self.shared_experts = DenseMLP(
                a.hidden_size, a.moe_intermediate_size * a.n_shared_experts
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.a
        # The router's logits in fp32, as DeepSeek's and transformers' code compute them
        # (Mistral 4's in the model's dtype, as transformers computes them).
        if a.router_fp32:
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)
        if a.topk_method == SOFTMAX_TOP2_GROUPS:
            weights, ids = select_experts_grouped(
                logits, None, a.num_experts_per_tok, a.num_groups, a.topk_groups,
                a.norm_topk_prob, a.routed_scaling_factor, scoring="softmax",
            )  # fmt: skip
        elif a.topk_method == "noaux_tc":
            weights, ids = select_experts_grouped(
                logits, self.e_score_correction_bias, a.num_experts_per_tok, a.num_groups,
                a.topk_groups, a.norm_topk_prob, a.routed_scaling_factor,
            )  # fmt: skip
        else:
            weights, ids = select_experts_group_limited(
                logits, a.num_experts_per_tok, a.num_groups, a.topk_groups, a.norm_topk_prob,
                a.routed_scaling_factor,
            )  # fmt: skip
        out = self.experts.apply(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)

    @torch.no_grad()
    def load(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        self.gate.weight.copy_(sd[prefix + "gate.weight"])
        if self.a.topk_method == "noaux_tc":
            self.e_score_correction_bias.copy_(sd[prefix + "gate.e_score_correction_bias"])
        if prefix + "experts.gate_up_proj" in sd:  # transformers 5's layout: stacked
            e, i, h = self.a.num_experts, self.a.moe_intermediate_size, self.a.hidden_size
            p = prefix + "experts."
            self.experts.w13.copy_(stacked_experts(sd, p + "gate_up_proj", (e, 2 * i, h)))
            self.experts.w2.copy_(stacked_experts(sd, p + "down_proj", (e, h, i)))
        else:  # checkpoints: one tensor per expert and projection
            for e in range(self.a.num_experts):
                p = f"{prefix}experts.{e}."
                gate, up, down = (sd[f"{p}{n}_proj.weight"] for n in ("gate", "up", "down"))
                self.experts.load_expert(e, gate, up, down)
        if self.shared_experts is not None:
            self.shared_experts.load(sd, prefix + "shared_experts.")


class MLAttention(nn.Module):
    """Multi-head latent attention, absorbed (the module docstring):
    ``(num_tokens, hidden) -> (num_tokens, hidden)``."""

    def __init__(self, a: DeepseekV2Arch) -> None:
        super().__init__()
        self.a = a
        heads, bias = a.num_heads, a.attention_bias
        if a.q_lora_rank is None:
            self.q_proj = nn.Linear(a.hidden_size, heads * a.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(a.hidden_size, a.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(a.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(a.q_lora_rank, heads * a.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            a.hidden_size, a.kv_lora_rank + a.qk_rope_head_dim, bias=bias
        )
        self.kv_a_layernorm = RMSNorm(a.kv_lora_rank, LATENT_NORM_EPS)
        # kv_b_proj split per head at load: W_UK_h (nope, rank), W_UV_h transposed (rank, v).
        self.w_uk = nn.Parameter(torch.empty(heads, a.qk_nope_head_dim, a.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(heads, a.kv_lora_rank, a.v_head_dim))
        self.o_proj = nn.Linear(heads * a.v_head_dim, a.hidden_size, bias=bias)
        # (q, k, None, kv_cache, meta, scale) -> (num_tokens, heads, kv_lora_rank)
        self.attn_forward = _no_attention_backend

    def forward(self, positions, h, rope: RotaryEmbedding, meta, kv_cache) -> torch.Tensor:
        query, key, _ = self.query_key(positions, h, rope)
        # No value: the backend reads c_kv, the key's first `rank` dims, from the cache.
        return self.output(
            self.attn_forward(query, key, None, kv_cache, meta, self.a.softmax_scale)
        )

    def query_key(
        self, positions, h, rope: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(absorbed query (n, heads, rank + r), key (n, 1, rank + r), q_a_layernorm's
        output (n, q_lora_rank), None without q_lora_rank: DSA's indexer reads it)."""
        a = self.a
        n, heads, rank, r = h.shape[0], a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim
        q_resid = None
        if a.q_lora_rank is None:
            q = self.q_proj(h)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(h))
            q = self.q_b_proj(q_resid)
        q = q.view(n, heads, a.qk_head_dim)
        latent, k_pe = self.kv_a_proj_with_mqa(h).split([rank, r], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())  # (n, rank): c_kv
        q_pe = q[..., a.qk_nope_head_dim :].reshape(n, heads * r)
        k_pe = k_pe.contiguous()  # (n, r): one key "head"
        rope(positions, q_pe, k_pe)  # in place
        q_latent = torch.bmm(q[..., : a.qk_nope_head_dim].transpose(0, 1), self.w_uk)
        # (n, heads, rank + r): what each head asks of the latent and of the rotated key
        query = torch.cat((q_latent.transpose(0, 1), q_pe.view(n, heads, r)), dim=-1)
        if a.query_scale_beta:  # Mistral 4: every dim of each head, per token
            scale = llama4_query_scale(positions, a.query_scale_beta, a.query_scale_original)
            query = query * scale.to(query.dtype)[:, None, None]
        key = torch.cat((latent, k_pe), dim=-1).unsqueeze(1)  # (n, 1, rank + r)
        return query, key, q_resid

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The backend's (n, heads, kv_lora_rank) rows -> (n, hidden): each head's through
        its ``W_UV``, then ``o_proj``."""
        a = self.a
        n = out.shape[0]
        o = torch.bmm(out.transpose(0, 1), self.w_uv)  # (heads, n, v_head_dim)
        return self.o_proj(o.transpose(0, 1).reshape(n, a.num_heads * a.v_head_dim))

    @torch.no_grad()
    def load(self, sd: dict[str, torch.Tensor], prefix: str) -> None:
        a = self.a
        names = ["kv_a_proj_with_mqa", "o_proj"]
        names += ["q_proj"] if a.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
        for name in names:
            linear = getattr(self, name)
            linear.weight.copy_(sd[f"{prefix}{name}.weight"])
            if linear.bias is not None:
                linear.bias.copy_(sd[f"{prefix}{name}.bias"])
        norms = ["kv_a_layernorm"] + ([] if a.q_lora_rank is None else ["q_a_layernorm"])
        for name in norms:
            getattr(self, name).weight.copy_(sd[f"{prefix}{name}.weight"])
        kv_b = sd[prefix + "kv_b_proj.weight"].view(
            a.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank
        )  # per head: the k_nope rows, then the value rows
        self.w_uk.copy_(kv_b[:, : a.qk_nope_head_dim])
        self.w_uv.copy_(kv_b[:, a.qk_nope_head_dim :].transpose(1, 2))


def _no_attention_backend(*args: Any) -> torch.Tensor:
    raise RuntimeError("no attention backend: call set_attention_backend first")


class DeepseekV2Layer(nn.Module):
    def __init__(self, a: DeepseekV2Arch, sparse: bool, attention: nn.Module | None = None) -> None:
        """``attention``: the layer's own (DSA's: ``models/deepseek_dsa.py``), else MLA."""
        super().__init__()
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.self_attn = MLAttention(a) if attention is None else attention
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = DeepseekMoE(a) if sparse else DenseMLP(a.hidden_size, a.intermediate_size)

    def forward(self, positions, x, residual, rope, meta, kv_cache):
        """(x, residual) -> (x, residual), as ``LlamaLayer``: the output is their sum."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, rope, meta, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekV2ForCausalLM(nn.Module):
    gguf_layout: ClassVar[Any] = None  # --quantization gguf: refused with its reason

    @staticmethod
    def arch_from_hf(hf_config: Any) -> DeepseekV2Arch:
        return DeepseekV2Arch.from_hf(hf_config)

    def __init__(self, arch: DeepseekV2Arch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = deepseek_rope(self.arch)
        # EAGLE-3 (spec_decode/eagle.py): the residual stream after each of these many
        # layers, concatenated in ``aux_hidden`` by every forward.
        self.aux_hidden_layers: frozenset[int] = frozenset()
        self.aux_hidden: torch.Tensor | None = None

    @staticmethod
    def make_layer(arch: DeepseekV2Arch, i: int) -> nn.Module:
        """Decoder layer ``i`` (a subclass's own: DSA's, ``models/deepseek_dsa.py``)."""
        return DeepseekV2Layer(arch, i in arch.sparse_layers)

    @property
    def attention_features(self) -> frozenset[str]:
        return frozenset()

    def set_attention_backend(self, backend: Any) -> None:
        """Every layer attends with ``backend``: multi-query attention over the latent
        (``arch.num_kv_heads`` 1, ``arch.head_dim`` the latent plus the rotated key), its
        values the keys' first ``arch.latent_value_size`` dims."""
        for layer in self.layers:
            layer.self_attn.attn_forward = layer_attention(backend)

    @torch.inference_mode()
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) ids -> (num_tokens, hidden): the embeddings the first layer reads."""
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, meta: Any, kv_caches, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(num_tokens,) ids -> (num_tokens, hidden) final hidden states. ``inputs_embeds``,
        when given, is read instead of the ids' embeddings (a multimodal model's, image rows
        written in); the forward may overwrite it (``LlamaForCausalLM.forward``)."""
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        aux = [x.clone()] if 0 in self.aux_hidden_layers else []
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(positions, x, residual, self.rope, meta, kv_cache)
            if i + 1 in self.aux_hidden_layers:  # a new tensor: the next norm works in place
                aux.append(x + residual)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        return self.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def init_buffers(self) -> None:
        """The rotary table (fp32 on the CPU, then moved in the weights' dtype) and the
        tied output head."""
        weight = self.embed_tokens.weight
        self.rope = deepseek_rope(self.arch).to(weight.dtype).to(weight.device)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy HF checkpoint tensors in (cast by ``copy_``), fusing gate/up and splitting
        ``kv_b_proj`` per head, after ``init_buffers``. Tensors of layers past
        ``num_hidden_layers`` (V3's multi-token-prediction layer) are not read."""
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        self.init_buffers()
        with torch.no_grad():
            load_embeddings_and_head(self, sd)
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                layer.self_attn.load(sd, p + "self_attn.")
                layer.mlp.load(sd, p + "mlp.")
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    getattr(layer, norm).weight.copy_(sd[p + norm + ".weight"])


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3/R1, Moonlight, Kimi-K2: V2's model; the config's defaults differ
    (``noaux_tc`` sigmoid routing, ``rope_interleave``), read by ``DeepseekV2Arch``."""


class Mistral4ForCausalLM(DeepseekV2ForCausalLM):
    """Mistral Small 4's language model (transformers' ``mistral4``): V2's model with its
    softmax routing in the best groups, its query scale by position and its rotated part of
    ``head_dim`` (module docstring), read by ``DeepseekV2Arch``."""


class Glm4MoeLiteForCausalLM(DeepseekV2ForCausalLM):
    """GLM-4.7-Flash (transformers' ``glm4_moe_lite``): DeepSeek-V3's latent attention and
    sigmoid routing with a correction bias (GLM-4.5's router, whatever the config's
    ``topk_method``), its MoE layers named by ``mlp_layer_types``; read by
    ``DeepseekV2Arch``. Its multi-token-prediction layer (index ``num_hidden_layers``) is
    not read."""
