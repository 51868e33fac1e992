"""Qwen3-Next and Qwen3.5 (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``, and the released Qwen3.5 checkpoints' multimodal classes, which
take images): hybrid models whose layers are Gated DeltaNet linear attention or gated full
attention (``layer_types``), as transformers computes them.

- **Linear attention** (``layers/gated_delta_net.py``): q, k, v, the output gate z and the
  per-head b, a projected from the input (one fused projection here, rows ``[q | k | v |
  z | b | a]``); q, k, v through a depthwise causal convolution and SiLU; the gated delta
  rule; the output RMS-normalised per head (plain weight) times ``silu(z)``
  (``RMSNormGated``). Its states live in the recurrent pools, not the KV cache: the model
  declares them (``recurrent_state_specs``) and ``forward`` takes the step's
  ``RecurrentBatch`` (``layers/recurrent.py``). Qwen3-Next's checkpoints hold
  ``in_proj_qkvz`` and ``in_proj_ba`` grouped by key head (per group ``[q | k | v | z]``
  and ``[b | a]``, its value heads consecutive), reordered at load; Qwen3.5's hold
  ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
- **Full attention**: q_proj gives each head's query and gate side by side (``[q_h |
  gate_h]``); q and k RMS-normalised per head; the first ``partial_rotary_factor`` of each
  head rotates (for text the plain rotation: Qwen3.5's M-RoPE rotates every frequency by
  the same position there); the output times ``sigmoid(gate)`` before o_proj.
- Every other norm scales by ``1 + weight`` (``GemmaRMSNorm``: zero-centred weights).
- The feed-forward: Qwen3.5's dense SiLU MLP; Qwen3.5-MoE's experts in every layer,
  Qwen3-Next's where ``mlp_only_layers`` and ``decoder_sparse_step`` leave them: softmax
  top-k routing plus a shared expert under a sigmoid gate (``moe.SparseMoeBlock``).

The arch's ``num_layers`` and head counts are the full-attention layers' (the KV cache has
a tensor per full-attention layer); ``layer_types`` holds every layer's kind.

Images (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``), as
Qwen3-VL's (``QwenVLForConditionalGeneration`` in ``llama.py``): Qwen3-VL's vision tower
without DeepStack (``qwen3_vl_vision.py``, ``model.visual.*``) makes each image's rows,
which the engine writes over its ``<|image_pad|>`` tokens' embeddings; the full-attention
layers rotate by M-RoPE, each of the rotated part's frequencies by the temporal, height or
width position, interleaved (transformers' ``Qwen3_5TextRotaryEmbedding``, whatever the
config's ``mrope_interleaved``: transformers does not read it) over ``mrope_section``
(``(3, num_tokens)`` positions). The linear-attention layers read image rows as any rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from vllm import _custom_ops as ops
from vllm.model_executor.layers.gated_delta_net import GatedDeltaNetMixer, GatedDeltaNetShape
from vllm.model_executor.layers.recurrent import RecurrentBatch, RecurrentStep, StateSpec
from vllm.model_executor.layers.rotary_embedding import (
    max_positions,
    rope_parameters,
    rotary_dim,
)
from vllm.model_executor.models.gemma import GemmaRMSNorm
from vllm.model_executor.models.hybrid_base import CheckpointTensors, HybridCausalLM, StepMixers
from vllm.model_executor.models.llama import (
    QwenVLForConditionalGeneration,
    RotaryEmbedding,
    _no_attention_backend,
    load_embeddings_and_head,
    mrope_step,
)
from vllm.model_executor.models.moe import SparseMoeBlock, load_moe_block
from vllm.model_executor.models.qwen2_vl_vision import QwenVLArch, vision_tower
from vllm.model_executor.models.qwen3_vl_vision import Qwen3VisionArch
from vllm.model_executor.models.utils import (
    LANGUAGE_MODEL_PREFIXES,
    LM_HEAD_KEYS,
    config_from_dict,
    language_model_tensors,
    takes_images,
)

logger = logging.getLogger(__name__)

LINEAR, FULL = "linear_attention", "full_attention"
# Where the multimodal checkpoints keep the vision tower: transformers 5's, then older.
VISION_PREFIXES = ("model.visual.", "visual.")
# transformers' M-RoPE sections where the text config's rope parameters name none.
MROPE_SECTION = (11, 11, 10)


@dataclass(frozen=True)
class Qwen3NextArch:
    hidden_size: int
    num_layers: int  # the full-attention layers: the KV cache's
    num_heads: int  # the full-attention layers' shapes
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int  # the rotary table's length
    tie_word_embeddings: bool
    rope: dict[str, Any]  # rotary_embedding.rope_parameters' dict
    layer_types: tuple[str, ...]  # every decoder layer's: LINEAR or FULL
    gdn: GatedDeltaNetShape
    fused_gdn_projections: bool  # Qwen3-Next's key-head-grouped in_proj_qkvz / in_proj_ba
    attention_bias: bool
    intermediate_size: int  # the dense MLP's
    # The experts (moe.SparseMoeBlock and load_moe_block read these by name).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()
    scoring: ClassVar[str] = "softmax"
    shared_expert_gated: ClassVar[bool] = True
    checkpoint_prefix: ClassVar[str] = "mlp"

    @classmethod
    def from_hf(cls, config: Any, tie_word_embeddings: bool | None = None) -> Qwen3NextArch:
        """The arch of a ``qwen3_next``, ``qwen3_5_text`` or ``qwen3_5_moe_text`` config;
        ``ValueError`` for another, or for what transformers would compute otherwise."""
        family = config.model_type
        if family not in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
            raise ValueError(f"model_type {family!r} is not Qwen3-Next or Qwen3.5")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu')")
        types = tuple(config.layer_types)
        if set(types) - {LINEAR, FULL} or len(types) != config.num_hidden_layers:
            raise ValueError(f"layer_types {list(types)}: one of {LINEAR!r} or {FULL!r} for "
                             f"each of the {config.num_hidden_layers} layers")  # fmt: skip
        rope = rope_parameters(config)
        heads = config.num_attention_heads
        if tie_word_embeddings is None:
            tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        return cls(
            hidden_size=config.hidden_size,
            num_layers=types.count(FULL),
            num_heads=heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=max_positions(config.max_position_embeddings, rope),
            tie_word_embeddings=tie_word_embeddings,
            rope=rope,
            layer_types=types,
            gdn=GatedDeltaNetShape(
                num_k_heads=config.linear_num_key_heads,
                num_v_heads=config.linear_num_value_heads,
                head_k_dim=config.linear_key_head_dim,
                head_v_dim=config.linear_value_head_dim,
                conv_kernel=config.linear_conv_kernel_dim,
            ),
            fused_gdn_projections=family == "qwen3_next",
            attention_bias=bool(getattr(config, "attention_bias", False)),
            intermediate_size=getattr(config, "intermediate_size", 0) or 0,
            **_experts(config, len(types)),
        )


def _experts(config: Any, num_layers: int) -> dict[str, Any]:
    """The arch's expert fields: Qwen3.5-MoE's in every layer (the top-k renormalised: its
    router always does), Qwen3-Next's in the layers ``mlp_only_layers`` and
    ``decoder_sparse_step`` leave sparse; none for Qwen3.5."""
    experts = getattr(config, "num_experts", 0) or 0
    if config.model_type == "qwen3_5_moe_text":
        sparse, norm = tuple(range(num_layers)), True
    elif config.model_type == "qwen3_next" and experts > 0:
        step = config.decoder_sparse_step or 1
        dense = set(config.mlp_only_layers or ())
        sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        norm = bool(config.norm_topk_prob)
    else:
        return {}
    return dict(
        num_experts=experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size or 0,
        norm_topk_prob=norm,
        sparse_layers=sparse,
    )


@dataclass(frozen=True)
class Qwen3_5VLArch(Qwen3NextArch):
    """A released Qwen3.5 checkpoint's arch: its language model's, and for images the
    vision tower's and the M-RoPE sections (``vision`` None: served as text)."""

    vision: Qwen3VisionArch | None = None
    # Per rotated frequency (the rotary's first half), how many read the temporal, height
    # and width position, interleaved (``mrope_axes``: Qwen3-VL's layout, reused).
    mrope_section: tuple[int, ...] = MROPE_SECTION
    mrope_interleaved: ClassVar[bool] = True
    mrope_axes = QwenVLArch.mrope_axes

    @classmethod
    def from_multimodal(cls, config: Any) -> Qwen3_5VLArch:
        """The arch of a ``Qwen3_5Config`` or ``Qwen3_5MoeConfig``: its ``text_config``'s
        with the head tied by the top-level flag (as transformers), and the tower of its
        ``vision_config``. ``ValueError`` when the M-RoPE sections do not cover the rotated
        frequencies, or the tower's output is not the language model's width."""
        tie = bool(getattr(config, "tie_word_embeddings", False))
        arch = cls.from_hf(config.get_text_config(), tie_word_embeddings=tie)
        if not takes_images(config):
            return arch
        section = tuple(arch.rope.get("mrope_section") or MROPE_SECTION)
        half = rotary_dim(arch.head_dim, arch.rope) // 2
        if len(section) != 3 or sum(section) != half:
            raise ValueError(f"rope mrope_section {list(section)}: three sections summing to "
                             f"the {half} rotated frequencies")  # fmt: skip
        vision = Qwen3VisionArch.from_hf(config.vision_config)
        if vision.out_hidden_size != arch.hidden_size:
            raise ValueError(
                f"the vision merger's output width {vision.out_hidden_size} is not the "
                f"language model's {arch.hidden_size}"
            )
        base = {f.name: getattr(arch, f.name) for f in fields(arch)}
        return cls(**{**base, "vision": vision, "mrope_section": section})


class RMSNormGated(nn.Module):
    """The linear attention's output norm: ``rms_norm(x) * weight * silu(z)`` per head, the
    norm in fp32 and rounded to x's dtype before the weight (as transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(GatedDeltaNetMixer):
    """(num_tokens, hidden) -> (num_tokens, hidden), reading and writing its states."""

    def __init__(self, a: Qwen3NextArch) -> None:
        super().__init__(a.gdn)
        s = a.gdn
        # rows [q | k | v | z | b | a], each block's heads in order
        width = s.conv_dim + s.value_dim + 2 * s.num_v_heads
        self.in_proj = nn.Linear(a.hidden_size, width, bias=False)
        self.norm = RMSNormGated(s.head_v_dim, a.rms_norm_eps)
        self.out_proj = nn.Linear(s.value_dim, a.hidden_size, bias=False)

    def forward(
        self, h: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor], step: RecurrentStep
    ) -> torch.Tensor:
        s = self.shape
        heads = s.num_v_heads
        qkv, z, b, a = self.in_proj(h).split([s.conv_dim, s.value_dim, heads, heads], dim=-1)
        core = self.mix(qkv, b, a, states, step)  # (num_tokens, v_heads, head_v_dim)
        out = self.norm(core, z.reshape(-1, heads, s.head_v_dim))
        return self.out_proj(out.reshape(-1, s.value_dim))

    def load(self, sd: dict[str, torch.Tensor], p: str, fused: bool) -> None:
        """From the checkpoint tensors of ``p`` (``layers.N.linear_attn.``)."""
        s = self.shape
        if fused:  # Qwen3-Next: per key head [q | k | v | z] and [b | a]; regrouped by kind
            r = s.num_v_heads // s.num_k_heads
            dk, dv = s.head_k_dim, r * s.head_v_dim
            qkvz = sd[p + "in_proj_qkvz.weight"].reshape(s.num_k_heads, 2 * dk + 2 * dv, -1)
            ba = sd[p + "in_proj_ba.weight"].reshape(s.num_k_heads, 2 * r, -1)
            parts = [*qkvz.split([dk, dk, dv, dv], dim=1), *ba.split([r, r], dim=1)]
            weight = torch.cat([t.flatten(0, 1) for t in parts])
        else:
            names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            weight = torch.cat([sd[f"{p}{n}.weight"] for n in names])
        self.in_proj.weight.copy_(weight)
        self.conv_weight.copy_(sd[p + "conv1d.weight"].reshape(s.conv_dim, s.conv_kernel))
        for name in ("dt_bias", "A_log"):
            getattr(self, name).copy_(sd[p + name])
        self.norm.weight.copy_(sd[p + "norm.weight"])
        self.out_proj.weight.copy_(sd[p + "out_proj.weight"])


class GatedAttention(nn.Module):
    """Full attention with per-head q/k norms, a partial rotation and a sigmoid output gate
    (module docstring); its K/V in the paged cache through the attention backend."""

    def __init__(self, a: Qwen3NextArch) -> None:
        super().__init__()
        self.a = a
        self.q_size, self.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        # rows [q_0 | gate_0 | q_1 | gate_1 | ... | k | v]
        self.qkv_proj = nn.Linear(a.hidden_size, 2 * self.q_size + 2 * self.kv_size,
                                  bias=a.attention_bias)  # fmt: skip
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.attention_bias)
        self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
        self.attn_forward = _no_attention_backend  # set_attention_backend
        self.scale = a.head_dim**-0.5

    def forward(self, positions, h, rope: RotaryEmbedding, meta: Any, kv_cache) -> torch.Tensor:
        a = self.a
        d = a.head_dim
        qg, k, v = self.qkv_proj(h).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(-1, a.num_heads, 2 * d)
        q = self.q_norm(qg[..., :d]).reshape(-1, self.q_size)  # new tensors
        k = self.k_norm(k.reshape(-1, a.num_kv_heads, d)).reshape(-1, self.kv_size)
        rope(positions, q, k)  # in place
        attn = self.attn_forward(
            q.view(-1, a.num_heads, d),
            k.view(-1, a.num_kv_heads, d),
            v.view(-1, a.num_kv_heads, d),
            kv_cache,
            meta,
            self.scale,
        )  # (num_tokens, heads, head_dim)
        return self.o_proj((attn * torch.sigmoid(qg[..., d:])).reshape(-1, self.q_size))

    def load(self, sd: dict[str, torch.Tensor], p: str) -> None:
        """From the checkpoint tensors of ``p`` (``layers.N.self_attn.``)."""
        kinds = ("weight", "bias") if self.a.attention_bias else ("weight",)
        for kind in kinds:
            qkv = [sd[f"{p}{n}_proj.{kind}"] for n in "qkv"]
            getattr(self.qkv_proj, kind).copy_(torch.cat(qkv))
            getattr(self.o_proj, kind).copy_(sd[f"{p}o_proj.{kind}"])
        self.q_norm.weight.copy_(sd[p + "q_norm.weight"])
        self.k_norm.weight.copy_(sd[p + "k_norm.weight"])


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, a: Qwen3NextArch, i: int) -> None:
        super().__init__()
        self.linear = a.layer_types[i] == LINEAR
        if self.linear:
            self.linear_attn = GatedDeltaNet(a)
        else:
            self.self_attn = GatedAttention(a)
        sparse = i in a.sparse_layers
        self.mlp = SparseMoeBlock(a) if sparse else DenseMLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)


class Qwen3NextForCausalLM(HybridCausalLM):
    """Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B), and the base of the
    Qwen3.5 classes below (module docstring)."""

    norm_class = GemmaRMSNorm

    @classmethod
    def arch_from_hf(cls, hf_config: Any) -> Qwen3NextArch:
        return Qwen3NextArch.from_hf(hf_config)

    @staticmethod
    def checkpoint_prefixes(hf_config: Any) -> tuple[str, ...]:
        """The tensors the model reads (the loader skips ``mtp.*``, the MTP head's)."""
        return ("model.", "lm_head.")

    def __init__(self, arch: Qwen3NextArch) -> None:
        super().__init__(arch)
        # Each layer's place among its kind's: its KV cache, or its recurrent states.
        kinds = arch.layer_types
        self._index = [kinds[:i].count(kind) for i, kind in enumerate(kinds)]

    def make_layer(self, i: int) -> nn.Module:
        return DecoderLayer(self.arch, i)

    def set_attention_backend(self, backend: Any) -> None:
        for layer in self.layers:
            if not layer.linear:
                layer.self_attn.attn_forward = backend.forward

    def recurrent_state_specs(self, ssm_dtype: torch.dtype) -> list[tuple[StateSpec, StateSpec]]:
        """Per linear-attention layer, in order: (its convolution's last inputs (conv_dim,
        kernel - 1) in the weights' dtype, its delta-rule state (v_heads, k_dim, v_dim) in
        ``ssm_dtype``)."""
        s = self.arch.gdn
        conv = StateSpec((s.conv_dim, s.conv_kernel - 1), self.embed_tokens.weight.dtype)
        ssm = StateSpec((s.num_v_heads, s.head_k_dim, s.head_v_dim), ssm_dtype)
        return [(conv, ssm)] * self.arch.layer_types.count(LINEAR)

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        layer, j = self.layers[i], self._index[i]
        h = layer.input_layernorm(x)
        if layer.linear:
            h = mixers.recurrent(layer.linear_attn, j, h)
        else:
            h = mixers.attention(layer.self_attn, j, h)
        x = x + h
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (``model.layers...`` or, as Qwen3.5's
        multimodal checkpoints, ``model.language_model.layers...``; others ignored),
        fusing the projections; ``ValueError`` naming a missing tensor."""
        if any(key.startswith(LANGUAGE_MODEL_PREFIXES) for key in sd):
            sd = language_model_tensors(sd)
        sd = CheckpointTensors({k.removeprefix("model."): v for k, v in sd.items()})
        self.init_buffers()
        with torch.no_grad():
            load_embeddings_and_head(self, sd)
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                if layer.linear:
                    layer.linear_attn.load(sd, p + "linear_attn.", self.arch.fused_gdn_projections)
                else:
                    layer.self_attn.load(sd, p + "self_attn.")
                for norm in ("input_layernorm", "post_attention_layernorm"):
                    getattr(layer, norm).weight.copy_(sd[f"{p}{norm}.weight"])
                if isinstance(layer.mlp, SparseMoeBlock):
                    load_moe_block(self.arch, layer.mlp, sd, p)
                else:
                    gate_up = [sd[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up")]
                    layer.mlp.gate_up_proj.weight.copy_(torch.cat(gate_up))
                    layer.mlp.down_proj.weight.copy_(sd[p + "mlp.down_proj.weight"])


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5's dense language model (``qwen3_5_text``) saved on its own."""


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE's language model (``qwen3_5_moe_text``) saved on its own."""


class Qwen3_5ForConditionalGeneration(Qwen3NextForCausalLM):
    """The released Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration``): the
    language model of ``text_config`` (``model.language_model.*``, ``lm_head``) and the
    vision tower (``model.visual.*``); the MTP layer (``mtp.*``) is read only by its draft
    head (``qwen3_next_mtp.py``).

    They take images as Qwen3-VL (module docstring): ``embed_images`` makes each image's
    rows, which the runner writes over its ``<|image_pad|>`` tokens' embeddings
    (``forward(..., inputs_embeds=)``); ``(3, num_tokens)`` positions rotate the
    full-attention layers by M-RoPE, ``(num_tokens,)`` positions (text, decode steps) by
    the plain rotation. A checkpoint without the tower's tensors is served as text. Videos
    are refused as for any model here."""

    # Decided per checkpoint (``takes_images``): an instance with its tower sets its own
    # True, and ``uses_mrope`` (its runner's positions).
    supports_images: ClassVar[bool] = False
    # The prompt's layout of an image (vllm.multimodal.processing): its patch grid's tokens.
    image_layout: ClassVar[str] = "grid"

    @classmethod
    def arch_from_hf(cls, hf_config: Any) -> Qwen3_5VLArch:
        return Qwen3_5VLArch.from_multimodal(hf_config)

    @classmethod
    def takes_images(cls, hf_config: Any) -> bool:
        """Whether the checkpoint of ``hf_config`` (transformers' config or the dict of its
        config.json) has a vision tower."""
        return takes_images(hf_config)

    @staticmethod
    def checkpoint_prefixes(hf_config: Any) -> tuple[str, ...]:
        vision = VISION_PREFIXES if takes_images(hf_config) else ()
        return (*LANGUAGE_MODEL_PREFIXES, *LM_HEAD_KEYS, *vision)

    def __init__(self, arch: Qwen3_5VLArch) -> None:
        super().__init__(arch)
        vision = getattr(arch, "vision", None)
        self.visual = None if vision is None else vision_tower(vision)
        self.supports_images = self.uses_mrope = vision is not None

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(patches, channels * temporal_patch * patch * patch) pixel values (any float
        dtype, any device) of images of ``grid_thw`` (images, 3) patches, concatenated ->
        (sum of t * h * w / merge ** 2, hidden) in the model's dtype, on its device: each
        image's rows in order, for its ``<|image_pad|>`` tokens."""
        if self.visual is None:
            raise ValueError("this Qwen3.5 checkpoint is served without images")
        return self.visual(pixel_values, grid_thw)

    # (3, num_tokens) positions -> this step's [cos | sin] rows: Qwen3-VL's gather over
    # our rotary table by ``arch.mrope_axes``.
    mrope_table = QwenVLForConditionalGeneration.mrope_table

    @torch.inference_mode()
    def forward(
        self,
        input_ids,
        positions,
        meta: Any,
        kv_caches,
        inputs_embeds: torch.Tensor | None = None,
        recurrent: RecurrentBatch | None = None,
    ) -> torch.Tensor:
        """``Qwen3NextForCausalLM.forward``; ``positions`` (3, num_tokens) rotate by M-RoPE:
        the full-attention layers run over this step's own table (``mrope_table``), row i
        for token i."""
        if positions.dim() == 1:
            return super().forward(input_ids, positions, meta, kv_caches, inputs_embeds, recurrent)
        with mrope_step(self, positions) as rows:
            return super().forward(input_ids, rows, meta, kv_caches, inputs_embeds, recurrent)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The language model's tensors (``Qwen3NextForCausalLM.load_weights``) and the
        tower's (``model.visual.*``, or ``visual.*``); without any tower tensor the model
        is its language model alone."""
        vision = {}
        for key, tensor in sd.items():
            prefix = next((p for p in VISION_PREFIXES if key.startswith(p)), None)
            if prefix is not None:
                vision[key.removeprefix(prefix)] = tensor
        super().load_weights(sd)
        if self.visual is None:
            return
        if not vision:
            logger.warning("no vision tower tensors in the checkpoint: served as text only")
            self.visual = None
            self.supports_images = self.uses_mrope = False
            return
        with torch.no_grad():
            self.visual.load_weights(vision)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The released Qwen3.5-MoE checkpoints (``Qwen3_5MoeForConditionalGeneration``), with
    images as ``Qwen3_5ForConditionalGeneration``."""


def qwen_vl_image_layout(hf_config: Any) -> tuple[int, int]:
    """(the ``<|image_pad|>`` token id, ``spatial_merge_size``) of a Qwen3.5 or Qwen3.5-MoE
    config (transformers' or the dict of its config.json): the engine's "grid" prompt
    layout (vllm.multimodal.processing), as transformers' ``Qwen3VLProcessor`` expands an
    image, ``t * h * w // spatial_merge_size ** 2`` of those tokens."""
    classes = {"qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig"}
    config = config_from_dict(hf_config, classes)
    return config.image_token_id, config.vision_config.spatial_merge_size


__all__ = [
    "Qwen3NextArch",
    "Qwen3_5VLArch",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "qwen_vl_image_layout",
]
