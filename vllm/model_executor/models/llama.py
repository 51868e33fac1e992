"""The Llama family (Llama, SmolLM2/3, Mistral, Ministral, Qwen2, Qwen3, Phi-3/Phi-4,
Granite, OLMo 2/3, EXAONE 4, Seed-OSS, GLM-4, ERNIE 4.5) over a flat packed batch.

One forward computes all scheduled tokens of all requests: ``input_ids`` and
``positions`` are flat ``(num_tokens,)``; attention reads and writes the paged KV cache
through the attention backend the model runner installs (``set_attention_backend``) and
the step's metadata it built. Qwen2 adds q/k/v biases, Qwen3 RMS-normalises q and k per head,
OLMo 2/3 over the whole projection and normalise each sublayer's output instead of its
input (EXAONE 4 too, with per-head q/k norms, and only its sliding-window layers rotate);
SmolLM3 leaves every fourth layer unrotated (``no_rope_layers``); OLMo 3 rotates its
sliding-window layers by their own parameters. Seed-OSS is Qwen2's attention (q/k/v
biases) with o_proj's bias under a flag of its own (``attention_out_bias``). Phi-3's
checkpoints hold q/k/v and gate/up already fused, as our layers do (GLM-4's gate/up too).
GLM-4 (GLM-4-0414, GLM-Z1) pairs adjacent dimensions in its rotation (GPT-J style) over
half of each head, and normalises each sublayer's output as well as its input (sandwich
norms); ERNIE 4.5 is Llama with that GPT-J-style rotation over the whole head. Registered
for the HF architectures in ``registry.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.model_executor.layers.quantization.gguf import GGUFLayout
from vllm.model_executor.layers.rotary_embedding import (
    cos_sin_cache,
    max_positions,
    rope_parameters,
)
from vllm.v1.attention.backends.abstract import layer_metadata


@dataclass(frozen=True)
class LlamaArch:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int  # the rotary table's length (the model's longest context)
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    o_bias: bool = False  # o_proj's bias (Llama's and Qwen3's attention_bias; not Qwen2's)
    # Granite's scalars: embeddings times embedding_multiplier, attention scaled by
    # attention_multiplier (None: 1 / sqrt(head_dim)), each sublayer's output times
    # residual_multiplier before the residual sum, logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # rotary_embedding.rope_parameters' dict (type, theta, scaling); None: default, theta
    rope_parameters: dict[str, Any] | None = None
    # Per layer, the sliding attention window (model_loader.layer_sliding_windows); empty
    # or None: the whole context.
    sliding_windows: tuple[int | None, ...] = ()
    # The sliding layers' own rotary parameters where the config gives them apart and they
    # differ (OLMo 3); None: every layer rotates by rope_parameters. Which layers are the
    # sliding ones: model_loader.sliding_layer_types (empty: none).
    rope_local_parameters: dict[str, Any] | None = None
    sliding_layers: tuple[bool, ...] = ()
    # Per layer, whether it rotates q and k (SmolLM3's no_rope_layers); empty: all do.
    rope_layers: tuple[bool, ...] = ()
    # OLMo 2/3: q and k RMS-normalised over the whole projection (not per head), and each
    # sublayer's output normalised before the residual sum, its input not at all.
    qk_norm_full: bool = False
    post_norms: bool = False
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip] (after the norms)
    # GLM-4 and ERNIE 4.5: q and k rotate adjacent dimensions as pairs (GPT-J style), not
    # each half of the rotated dimensions against the other (Neox style, rotate_half).
    rope_interleaved: bool = False
    # GLM-4: each sublayer's output RMS-normalised before the residual sum
    # (post_self_attn_layernorm, post_mlp_layernorm), besides its input as Llama's.
    sandwich_norms: bool = False

    @classmethod
    def from_hf(cls, config) -> LlamaArch:
        from vllm.model_executor.model_loader import layer_sliding_windows, sliding_layer_types

        rope = rope_parameters(config)
        local = rope_parameters(config, "sliding_attention")
        family = config.model_type.removesuffix("_moe")  # qwen2_moe, qwen3_moe: same attention
        olmo = family in ("olmo2", "olmo3")  # and OLMoE, whose norms are Llama's
        n_layers = config.num_hidden_layers
        no_rope = getattr(config, "no_rope_layers", None) if family == "smollm3" else None
        if family == "exaone4" and layer_sliding_windows(config) != (None,) * n_layers:
            no_rope = sliding_layer_types(config)  # its global layers do not rotate
        heads = config.num_attention_heads
        if getattr(config, "mlp_bias", False):
            raise ValueError(f"mlp_bias is not supported ({config.model_type} config)")
        if family == "ernie4_5" and config.use_bias:  # every projection's, the MLPs' too
            raise ValueError(f"use_bias is not supported ({config.model_type} config)")
        glm4 = config.model_type == "glm4"  # not GLM-4.5's glm4_moe: Llama's rotation, norms
        bias = bool(
            getattr(config, "attention_bias", getattr(config, "qkv_bias", family == "qwen2"))
        )
        granite = family in ("granite", "granitemoe")  # its four scalars
        o_bias = bias and family in (
            "llama", "qwen3", "granite", "olmo2", "olmo3", "smollm3", "gpt_oss"
        )  # fmt: skip
        if family == "seed_oss":  # its own flag, apart from q/k/v's
            o_bias = bool(config.attention_out_bias)
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=rope["rope_theta"],
            max_position_embeddings=max(
                max_positions(config.max_position_embeddings, rope),
                max_positions(config.max_position_embeddings, local),
            ),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=family in ("qwen3", "exaone4") or bool(getattr(config, "use_qk_norm", False)),
            o_bias=o_bias,
            rope_parameters=rope,
            embedding_multiplier=config.embedding_multiplier if granite else 1.0,
            attention_multiplier=config.attention_multiplier if granite else None,
            residual_multiplier=config.residual_multiplier if granite else 1.0,
            logits_scaling=config.logits_scaling if granite else 1.0,
            sliding_windows=layer_sliding_windows(config),
            rope_local_parameters=local if local != rope else None,
            sliding_layers=sliding_layer_types(config),
            rope_layers=tuple(bool(r) for r in no_rope) if no_rope else (),
            qk_norm_full=olmo or family == "olmoe",
            post_norms=olmo or family == "exaone4",
            clip_qkv=getattr(config, "clip_qkv", None) if family == "olmoe" else None,
            rope_interleaved=glm4 or family == "ernie4_5",  # and ERNIE-4.5-MoE
            sandwich_norms=glm4,
        )

    def layer_rope(self, layer: int) -> str | None:
        """Which rotary table layer ``layer`` uses: "global", "local" (a sliding layer with
        its own parameters) or None (it does not rotate)."""
        if self.rope_layers and not self.rope_layers[layer]:
            return None
        sliding = self.sliding_layers and self.sliding_layers[layer]
        return "local" if sliding and self.rope_local_parameters is not None else "global"

    @property
    def rope(self) -> dict[str, Any]:
        return self.rope_parameters or {"rope_type": "default", "rope_theta": self.rope_theta}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``, computed in
        place in ``x`` and ``residual`` by one fused op (vLLM's calling convention)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half), as HF Llama checkpoints expect; of the
    first ``rotary_dim(head_dim, params)`` dimensions of each head (all but for a partial
    rotary embedding, the table's width)."""

    def __init__(
        self, head_dim: int, max_pos: int, params: dict[str, Any], neox: bool = True
    ) -> None:
        super().__init__()
        # (max_pos, head_dim) = [cos | sin], vLLM's layout: the op gathers rows by position.
        cache = cos_sin_cache(head_dim, max_pos, params)  # params: rope_parameters' dict
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.head_dim = head_dim
        self.neox = neox  # False: GPT-J style, adjacent dimensions paired (Cohere)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q (T, heads * head_dim) and k (T, kv_heads * head_dim) in place."""
        rotate = ops.rotary_embedding if self.neox else ops.rotary_embedding_interleaved
        rotate(positions, q, k, self.head_dim, self.cos_sin_cache)


class LlamaLayer(nn.Module):
    """Attention, then the feed-forward: the dense SiLU-gated MLP (``gate_up_proj``,
    ``down_proj``), or ``mlp`` when given (a mixture of experts: ``models/moe.py``)."""

    def __init__(self, a: LlamaArch, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.a = a
        self.scale = a.attention_multiplier or 1.0 / math.sqrt(a.head_dim)
        init_projections(self, a, a.attention_bias, a.o_bias, mlp is None)
        self.mlp = mlp
        if not a.post_norms:  # OLMo 2/3 normalise outputs, not inputs
            self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        # (q, k, v, kv_cache, meta, scale) -> (num_tokens, heads, head_dim)
        self.attn_forward: Callable[..., torch.Tensor] = _no_attention_backend
        # The backend leaves this step's K/V write to the rotary op (one fused kernel).
        self.rope_writes_kv = False
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.post_norms:
            self.post_feedforward_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.sandwich_norms:
            self.post_self_attn_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.qk_norm:
            self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        elif a.qk_norm_full:
            self.q_norm = RMSNorm(self.q_size, a.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, a.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryEmbedding | None,
        meta: Any,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(x, residual) -> (x, residual): the layer's output is ``x + residual`` (the sum is
        left to the next norm, which fuses it). ``residual`` None: x is the embedding (or,
        with post-norms, the whole residual stream: such a layer returns it whole, with
        None). ``rope`` None: the layer does not rotate q and k."""
        a = self.a
        if a.post_norms:
            return self._forward_post_norms(positions, x, rope, meta, kv_cache), None
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        out = self._attention(positions, h, rope, meta, kv_cache)
        if a.sandwich_norms:
            out = self.post_self_attn_layernorm(out)
        if a.residual_multiplier != 1.0:
            out = out * a.residual_multiplier
        h, residual = self.post_attention_layernorm(out, residual)
        if self.mlp is not None:
            out = self.mlp(h)
        else:
            out = self.down_proj(ops.silu_and_mul(self.gate_up_proj(h)))
        if a.sandwich_norms:
            out = self.post_mlp_layernorm(out)
        return (out * a.residual_multiplier if a.residual_multiplier != 1.0 else out), residual

    def _forward_post_norms(self, positions, x, rope, meta, kv_cache) -> torch.Tensor:
        """OLMo 2/3: ``x + norm(attention(x))``, then ``+ norm(mlp(.))``."""
        x = x + self.post_attention_layernorm(self._attention(positions, x, rope, meta, kv_cache))
        out = self.mlp(x) if self.mlp is not None else (
            self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
        )  # fmt: skip
        return x + self.post_feedforward_layernorm(out)

    def _attention(self, positions, h, rope, meta, kv_cache) -> torch.Tensor:
        """o_proj(attention(h)): (num_tokens, hidden)."""
        a = self.a
        qkv = self.qkv_proj(h)  # (num_tokens, q_size + 2 * kv_size)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if a.qk_norm:  # per-head norms with their own weights, before the rotation
            q = self.q_norm(q.reshape(-1, a.num_heads, a.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, a.num_kv_heads, a.head_dim)).view(-1, self.kv_size)
        elif a.qk_norm_full:  # one norm over all heads
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        if self.rope_writes_kv and rope is not None and rope.neox:  # rotate, write: 1 kernel
            ops.rotary_embedding_and_cache(
                positions, q, k, v, a.head_dim, rope.cos_sin_cache, kv_cache, meta.slot_mapping
            )
            k3 = v3 = None  # in the cache already
        else:
            if rope is not None:
                rope(positions, q, k)  # in place: strided views of qkv
            k3, v3 = k.view(-1, a.num_kv_heads, a.head_dim), v.view(-1, a.num_kv_heads, a.head_dim)
        attn = self.attn_forward(
            q.view(-1, a.num_heads, a.head_dim), k3, v3, kv_cache, meta, self.scale
        )  # (num_tokens, heads, head_dim)
        return self.o_proj(attn.reshape(-1, self.q_size))


def init_projections(
    layer: nn.Module, a: Any, qkv_bias: bool, o_bias: bool, mlp: bool = True
) -> None:
    """Give ``layer`` the families' shared projections, shaped by the arch ``a`` (its
    ``hidden_size``, heads, ``head_dim``, ``intermediate_size``): ``q_size``, ``kv_size``,
    the fused ``qkv_proj`` and ``o_proj`` (with their biases) and, with ``mlp``, the fused
    ``gate_up_proj`` and ``down_proj``; ``load_projections`` fills them."""
    layer.q_size = a.num_heads * a.head_dim
    layer.kv_size = a.num_kv_heads * a.head_dim
    layer.qkv_proj = nn.Linear(a.hidden_size, layer.q_size + 2 * layer.kv_size, bias=qkv_bias)
    layer.o_proj = nn.Linear(layer.q_size, a.hidden_size, bias=o_bias)
    if mlp:
        layer.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        layer.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)


def load_embeddings_and_head(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Fill ``model``'s ``embed_tokens``, final ``norm`` and (untied) ``lm_head`` from HF
    checkpoint tensors named without their ``model.`` prefix (a checkpoint without an
    ``lm_head`` ties it)."""
    model.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
    model.norm.weight.copy_(sd["norm.weight"])
    if not model.arch.tie_word_embeddings:
        model.lm_head.weight.copy_(sd.get("lm_head.weight", sd["embed_tokens.weight"]))


def load_projections(
    layer: nn.Module,
    sd: dict[str, torch.Tensor],
    prefix: str,
    qkv_bias: bool,
    o_bias: bool,
    mlp: bool = True,
) -> None:
    """Fill a layer's fused ``qkv_proj`` (and its bias), ``o_proj`` (and its bias) and,
    with ``mlp``, its fused ``gate_up_proj`` and ``down_proj``, from the HF checkpoint
    tensors of the layer ``prefix`` (``layers.N.``): the families' shared projections."""
    att = prefix + "self_attn."
    fused = LlamaForCausalLM.fused
    layer.qkv_proj.weight.copy_(fused(sd, att, ("q_proj", "k_proj", "v_proj"), "qkv_proj"))
    if qkv_bias:
        layer.qkv_proj.bias.copy_(torch.cat([sd[att + f"{n}_proj.bias"] for n in "qkv"]))
    layer.o_proj.weight.copy_(sd[att + "o_proj.weight"])
    if o_bias:
        layer.o_proj.bias.copy_(sd[att + "o_proj.bias"])
    if mlp:
        gate_up = fused(sd, prefix + "mlp.", ("gate_proj", "up_proj"), "gate_up_proj")
        layer.gate_up_proj.weight.copy_(gate_up)
        layer.down_proj.weight.copy_(sd[prefix + "mlp.down_proj.weight"])


def _no_attention_backend(*args: Any) -> torch.Tensor:
    raise RuntimeError("no attention backend: call set_attention_backend first")


def attention_features(
    sliding_windows: tuple[int | None, ...], logits_soft_cap: float | None = None
) -> frozenset[str]:
    """The ``AttentionBackend.supported_features`` a model with these layers needs."""
    features = set()
    if any(w is not None for w in sliding_windows):
        features.add("sliding_window")
    if logits_soft_cap is not None:
        features.add("logits_soft_cap")
    return frozenset(features)


def layer_attention(backend: Any, **features: Any) -> Callable[..., torch.Tensor]:
    """``backend.forward`` with a layer's own keyword arguments (its sliding window, its
    soft cap) bound; the plain method when it has none (every backend takes that)."""
    features = {k: v for k, v in features.items() if v is not None}
    return partial(backend.forward, **features) if features else backend.forward


class LlamaForCausalLM(nn.Module):
    # llama.cpp's tensors for our fused layers. Its converter interleaves the q/k rotary
    # halves for its "llama" architecture (Llama, Mistral, SmolLM2), not for qwen2/qwen3.
    gguf_layout: ClassVar[GGUFLayout] = GGUFLayout(
        layer_tensors={
            "qkv_proj": ("attn_q", "attn_k", "attn_v"),
            "o_proj": ("attn_output",),
            "gate_up_proj": ("ffn_gate", "ffn_up"),
            "down_proj": ("ffn_down",),
        },
        head_tensors=("output", "token_embd"),
        permuted={"llama": {"attn_q": "num_heads", "attn_k": "num_kv_heads"}},
        elementwise_pairs=(("gate_up_proj", "down_proj"),),  # silu_and_mul between
    )

    @staticmethod
    def arch_from_hf(hf_config: Any) -> LlamaArch:
        return LlamaArch.from_hf(hf_config)

    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            LlamaLayer(arch, self.make_mlp(i)) for i in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = self.rotary_embedding(arch.rope)
        self.rope_local = None  # the sliding layers' table, where they have their own
        if arch.rope_local_parameters is not None:
            self.rope_local = self.rotary_embedding(arch.rope_local_parameters)
        self._layer_ropes = [arch.layer_rope(i) for i in range(arch.num_layers)]
        # EAGLE-3 (spec_decode/eagle.py): the residual stream after each of these many
        # layers, concatenated in ``aux_hidden`` by every forward.
        self.aux_hidden_layers: frozenset[int] = frozenset()
        self.aux_hidden: torch.Tensor | None = None

    def make_mlp(self, layer: int) -> nn.Module | None:
        """Layer ``layer``'s feed-forward module, None for the dense MLP (every layer here)."""
        return None

    def rotary_embedding(self, params: dict[str, Any]) -> RotaryEmbedding:
        """The rotary table of ``params`` for this arch's heads (fp32, on the CPU), its
        dimensions paired as the arch's checkpoints expect (``rope_interleaved``)."""
        a = self.arch
        return RotaryEmbedding(
            a.head_dim, a.max_position_embeddings, params, neox=not a.rope_interleaved
        )

    @property
    def attention_features(self) -> frozenset[str]:
        """What the layers ask of the attention backend beyond causal attention
        (``AttentionBackend.supported_features``): the selector picks one that has it."""
        return attention_features(self.arch.sliding_windows)

    def set_attention_backend(self, backend: Any) -> None:
        """Every layer attends with ``backend`` (an ``AttentionBackend`` instance), a
        sliding-window layer with its window."""
        fused_write = getattr(backend, "writes_kv_with_rotary", False)
        windows = self.arch.sliding_windows or (None,) * len(self.layers)
        for layer, window in zip(self.layers, windows, strict=True):
            features = self.layer_attention_features(layer)
            layer.attn_forward = layer_attention(backend, sliding_window=window, **features)
            layer.rope_writes_kv = fused_write

    def layer_attention_features(self, layer: nn.Module) -> dict[str, Any]:
        """A layer's attention keyword arguments besides its window (gpt-oss: its sinks)."""
        return {}

    @torch.inference_mode()
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) ids -> (num_tokens, hidden): the embeddings the first layer reads
        (Granite's times its ``embedding_multiplier``); a new tensor."""
        x = self.embed_tokens(input_ids)
        if self.arch.embedding_multiplier != 1.0:
            x = x * self.arch.embedding_multiplier
        return x

    @torch.inference_mode()
    def forward(
        self,
        input_ids,
        positions,
        meta: Any,
        kv_caches,
        inputs_embeds: torch.Tensor | None = None,
        deepstack: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(num_tokens,) ids -> (num_tokens, hidden) final hidden states. ``inputs_embeds``
        (num_tokens, hidden), when given, is read instead of ``embed_input_ids(input_ids)``
        (a multimodal model's: image rows written in); it becomes the first layer's
        residual stream, which the fused norms update in place: the forward may overwrite
        it. ``deepstack`` (n, num_tokens, hidden), when given: ``deepstack[i]`` is added
        to the hidden state after layer i, for i < n (Qwen3-VL's image features)."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        ropes = {"global": self.rope, "local": self.rope_local, None: None}
        metas = layer_metadata(meta, len(self.layers))  # the hybrid KV cache's groups
        aux = [x.clone()] if 0 in self.aux_hidden_layers else []
        for i, (layer, kv_cache, kind, m) in enumerate(
            zip(self.layers, kv_caches, self._layer_ropes, metas, strict=True)
        ):
            x, residual = layer(positions, x, residual, ropes[kind], m, kv_cache)
            if deepstack is not None and i < deepstack.shape[0]:
                x = x + deepstack[i]  # the hidden state is x + residual (or x alone)
            if i + 1 in self.aux_hidden_layers:  # a new tensor: the next norm works in place
                aux.append(x.clone() if residual is None else x + residual)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits if self.arch.logits_scaling == 1.0 else logits / self.arch.logits_scaling

    def init_buffers(self) -> None:
        """What no checkpoint holds: the rotary table, computed in fp32 on the CPU and moved
        to the weights' device already in their dtype, and the tied output head."""
        a = self.arch
        weight = self.embed_tokens.weight
        self.rope = self.rotary_embedding(a.rope).to(weight.dtype).to(weight.device)
        if a.rope_local_parameters is not None:
            local = self.rotary_embedding(a.rope_local_parameters)
            self.rope_local = local.to(weight.dtype).to(weight.device)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy HF checkpoint tensors in (each cast to the weights' dtype by ``copy_`` as it
        goes), fusing q/k/v and gate/up projections, after ``init_buffers``."""
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        self.init_buffers()
        with torch.no_grad():
            load_embeddings_and_head(self, sd)
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                att = p + "self_attn."
                a = self.arch
                load_projections(layer, sd, p, a.attention_bias, a.o_bias, layer.mlp is None)
                if layer.mlp is not None:
                    self.load_mlp(layer.mlp, sd, p)
                norms = ["post_attention_layernorm"]
                norms += ["post_feedforward_layernorm"] if self.arch.post_norms else (
                    ["input_layernorm"]
                )  # fmt: skip
                if self.arch.sandwich_norms:
                    norms += ["post_self_attn_layernorm", "post_mlp_layernorm"]
                for norm in norms:
                    getattr(layer, norm).weight.copy_(sd[p + norm + ".weight"])
                if self.arch.qk_norm or self.arch.qk_norm_full:
                    layer.q_norm.weight.copy_(sd[att + "q_norm.weight"])
                    layer.k_norm.weight.copy_(sd[att + "k_norm.weight"])

    @staticmethod
    def fused(sd, prefix: str, parts: tuple[str, ...], fused: str) -> torch.Tensor:
        """The weight of our fused layer ``fused`` (q/k/v, gate/up): the checkpoint's own
        fused tensor where it has one (Phi-3), else its ``parts`` concatenated."""
        if prefix + fused + ".weight" in sd:
            return sd[prefix + fused + ".weight"]
        return torch.cat([sd[f"{prefix}{part}.weight"] for part in parts])

    def load_mlp(self, mlp: nn.Module, sd: dict[str, torch.Tensor], prefix: str) -> None:
        """Fill a ``make_mlp`` module from the checkpoint tensors of the layer ``prefix``."""
        raise NotImplementedError(f"{type(self).__name__} makes no feed-forward module")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4 (``Phi3ForCausalLM``): Llama's layer, with checkpoints that
    fuse q/k/v and gate/up (``fused`` reads them); the 128k variants' longrope and
    Phi-4-mini's partial rotary come from ``rotary_embedding``."""

    gguf_layout: ClassVar[Any] = None  # llama.cpp's phi3 tensors are fused differently


@contextlib.contextmanager
def mrope_step(model: Any, positions: torch.Tensor):
    """A step of ``(3, num_tokens)`` M-RoPE positions: ``model.rope`` reads this step's own
    table (``model.mrope_table``, row i for token i) until the block ends; yields the rows
    ``0..num_tokens-1`` that index it, the positions its layers are given."""
    rope, table = model.rope, model.rope.cos_sin_cache
    rope.cos_sin_cache = model.mrope_table(positions)
    try:
        yield torch.arange(positions.shape[1], device=positions.device)
    finally:
        rope.cos_sin_cache = table


class QwenVLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL's dense checkpoints: the Qwen2 or Qwen3 language
    model of ``text_config`` (its tensors under ``model.``, beside the vision tower's under
    ``visual.``, or under ``model.language_model.`` beside ``model.visual.``). Qwen3-VL-MoE
    is this model with Qwen3-MoE's experts (``qwen3_vl_moe.py``).

    They take images (``takes_images``): the vision tower (``qwen2_vl_vision.py``,
    ``qwen3_vl_vision.py``) makes each image's rows (``embed_images``), which the engine
    writes over its ``<|image_pad|>`` tokens' embeddings (``merge_image_rows``, then
    ``forward(..., inputs_embeds=)``), and their multimodal rotation (M-RoPE) rotates each
    rotary frequency by one of three positions (temporal, height, width: ``mrope_section``,
    contiguous runs, or interleaved for Qwen3-VL), which ``forward`` takes as
    ``(3, num_tokens)`` positions. Where a token's three are equal (text, decode steps)
    M-RoPE is the plain rotation: ``(num_tokens,)`` positions run the language model as
    for any other. Qwen3-VL's DeepStack: the tower's rows carry extra features, which the
    language model adds at the image tokens after its first layers. Videos are refused as
    for any model here."""

    gguf_layout: ClassVar[Any] = None
    # Decided per config: ``takes_images``. An instance that takes images sets its own
    # True, and ``uses_mrope`` (its runner's positions).
    supports_images: ClassVar[bool] = False
    # The prompt's layout of an image (vllm.multimodal.processing): its patch grid's tokens.
    image_layout: ClassVar[str] = "grid"
    _TEXT_FAMILIES: ClassVar[dict[str, str]] = {
        "qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
    }  # fmt: skip
    _VISION_PREFIXES: ClassVar[tuple[str, ...]] = ("model.visual.", "visual.")

    @classmethod
    def arch_from_hf(cls, hf_config: Any) -> LlamaArch:
        """The language model's arch; for a checkpoint that takes images a ``QwenVLArch``,
        with the M-RoPE sections and the vision tower's arch."""
        from vllm.model_executor.models.qwen2_vl_vision import QwenVLArch, takes_images

        arch = LlamaArch.from_hf(cls.text_config(hf_config))
        return QwenVLArch.from_text(arch, hf_config) if takes_images(hf_config) else arch

    @classmethod
    def text_config(cls, hf_config: Any) -> Any:
        """A copy of the language model's config whose ``model_type`` is its text family's
        (``_TEXT_FAMILIES``: Qwen2's attention biases, Qwen3's q/k norms, Qwen3-MoE's
        experts); ``ValueError`` for a language model this class does not run."""
        import copy

        text = copy.copy(hf_config.get_text_config())
        family = cls._TEXT_FAMILIES.get(text.model_type)
        if family is None:
            raise ValueError(
                f"model_type {text.model_type!r} is not a language model of {cls.__name__}"
            )
        text.model_type = family
        return text

    @classmethod
    def takes_images(cls, hf_config: Any) -> bool:
        """Whether the checkpoint of ``hf_config`` (transformers' config or the dict of its
        config.json) is served with images: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and
        Qwen3-VL-MoE."""
        from vllm.model_executor.models.qwen2_vl_vision import takes_images

        return takes_images(hf_config)

    def __init__(self, arch: LlamaArch) -> None:
        from vllm.model_executor.models.qwen2_vl_vision import vision_tower

        super().__init__(arch)
        vision = getattr(arch, "vision", None)
        self.visual = None if vision is None else vision_tower(vision)
        self.supports_images = self.uses_mrope = vision is not None
        # merge_image_rows' deepstack features: (the embeddings they go with, the features)
        self._deepstack: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """(patches, channels * temporal_patch * patch * patch) pixel values (any float
        dtype, any device) of images of ``grid_thw`` (images, 3) patches, concatenated ->
        (sum of t * h * w / merge ** 2, hidden * (1 + n)) in the model's dtype, on its
        device: each image's rows in order, for its ``<|image_pad|>`` tokens
        (``merge_image_rows``); n: Qwen3-VL's deepstack features (0 for Qwen2-VL and
        Qwen2.5-VL), after the embedding on the last dimension."""
        if self.visual is None:
            raise ValueError("this Qwen-VL checkpoint is served without images")
        return self.visual(pixel_values, grid_thw)

    def merge_image_rows(
        self, embeds: torch.Tensor, rows: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write images' rows (``embed_images``' rows, (len(rows), hidden * (1 + n))) into
        the step's embeddings ``embeds`` (num_tokens, hidden) at ``rows`` (LongTensor, on
        their device): the embeddings in place; with n deepstack features, those are kept
        as (n, num_tokens, hidden), zeros but at ``rows``, for the next ``forward`` alone,
        which adds them when its ``inputs_embeds`` is ``embeds`` (and drops them either
        way, so that nothing stale reaches a later step)."""
        hidden = embeds.shape[1]
        embeds.index_copy_(0, rows, values[:, :hidden])
        n = values.shape[1] // hidden - 1
        if n:
            features = values[:, hidden:].view(-1, n, hidden).transpose(0, 1)  # (n, rows, h)
            stack = embeds.new_zeros(n, embeds.shape[0], hidden)
            self._deepstack = embeds, stack.index_copy_(1, rows, features)

    def mrope_table(self, positions: torch.Tensor) -> torch.Tensor:
        """(num_tokens, rot_dim) [cos | sin] rows of M-RoPE for (3, num_tokens) positions:
        column j of each half from the rotary table's row at the position that rotates
        frequency j (``QwenVLArch.mrope_axes``)."""
        axes = getattr(self.arch, "mrope_axes", None)
        if axes is None:
            raise ValueError("(3, num_tokens) positions: this model has no M-RoPE")
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"positions of shape {tuple(positions.shape)}: (3, num_tokens)")
        which = torch.tensor(axes * 2, device=positions.device)  # cos, then sin
        table = self.rope.cos_sin_cache  # (max_pos, rot_dim)
        return table.gather(0, positions[which].T.contiguous())  # [t, c] = table[pos, c]

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, meta: Any, kv_caches, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``LlamaForCausalLM.forward``, with the deepstack features ``merge_image_rows``
        kept for ``inputs_embeds``; ``positions`` (3, num_tokens) rotate by M-RoPE: the
        layers run over this step's own table (``mrope_table``), row i for token i."""
        pending, self._deepstack = self._deepstack, None
        deepstack = None
        if pending is not None and pending[0] is inputs_embeds:
            deepstack = pending[1]
        if positions.dim() == 1:
            return super().forward(input_ids, positions, meta, kv_caches, inputs_embeds, deepstack)
        with mrope_step(self, positions) as rows:
            return super().forward(input_ids, rows, meta, kv_caches, inputs_embeds, deepstack)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The language model's tensors (``LlamaForCausalLM.load_weights``) and, where the
        tower is built, the tower's, from either layout (class docstring)."""
        from vllm.model_executor.models.utils import language_model_tensors

        vision = {}
        for key, tensor in sd.items():
            prefix = next((p for p in self._VISION_PREFIXES if key.startswith(p)), None)
            if prefix is not None:
                vision[key.removeprefix(prefix)] = tensor
        if any(key.startswith("model.language_model.") for key in sd):
            sd = language_model_tensors(sd)
        super().load_weights(sd)
        if self.visual is not None:
            with torch.no_grad():
                self.visual.load_weights(vision)


def qwen_vl_image_layout(hf_config: Any) -> tuple[int, int]:
    """(the ``<|image_pad|>`` token id, ``spatial_merge_size``) of a Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL or Qwen3-VL-MoE config: ``qwen2_vl_vision.qwen_vl_image_layout``, here beside
    the model class."""
    from vllm.model_executor.models.qwen2_vl_vision import qwen_vl_image_layout as layout

    return layout(hf_config)
