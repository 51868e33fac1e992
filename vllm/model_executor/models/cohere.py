"""Cohere's Command models (``CohereForCausalLM``: Command R, R+; ``Cohere2ForCausalLM``:
Command R7B, Command A) over a flat packed batch.

Llama's fused projections and paged attention (``llama.py``) with Cohere's block, as
transformers computes it:

- one LayerNorm (mean-centred, a weight and no bias, in fp32) feeds attention and the MLP
  in parallel: ``x + attention(norm(x)) + mlp(norm(x))``;
- GPT-J-style rotary embedding (adjacent dimensions paired: ``ops.rotary_embedding_interleaved``);
- logits times ``logit_scale``; the output head tied to the embeddings;
- Command R: optional per-head LayerNorms of q and k (``use_qk_norm``);
- Cohere 2: three of four layers over a sliding window, which alone rotate q and k; the
  global layers use no position embedding at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.model_executor.layers.rotary_embedding import max_positions, rope_parameters
from vllm.model_executor.models.llama import (
    RotaryEmbedding,
    _no_attention_backend,
    attention_features,
    init_projections,
    layer_attention,
    load_embeddings_and_head,
    load_projections,
)
from vllm.v1.attention.backends.abstract import layer_metadata


@dataclass(frozen=True)
class CohereArch:
    family: str  # "cohere" or "cohere2"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    layer_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    logit_scale: float
    rope: dict[str, Any]
    sliding_windows: tuple[int | None, ...]
    rope_layers: tuple[bool, ...]  # which layers rotate q and k
    attention_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, config) -> CohereArch:
        from vllm.model_executor.model_loader import layer_sliding_windows, sliding_layer_types

        family = config.model_type
        if family not in ("cohere", "cohere2"):
            raise ValueError(f"model_type {family!r} is not a Cohere model")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        heads = config.num_attention_heads
        rope = rope_parameters(config)
        n = config.num_hidden_layers
        return cls(
            family=family,
            hidden_size=config.hidden_size,
            num_layers=n,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            layer_norm_eps=config.layer_norm_eps,
            max_position_embeddings=max_positions(config.max_position_embeddings, rope),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            logit_scale=float(getattr(config, "logit_scale", 1.0)),
            rope=rope,
            sliding_windows=layer_sliding_windows(config),
            rope_layers=sliding_layer_types(config) if family == "cohere2" else (True,) * n,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=bool(getattr(config, "use_qk_norm", False)),
        )


class CohereLayerNorm(nn.Module):
    """``(x - mean) / std * weight`` over the last dimension, in fp32 (no bias); ``shape``
    (heads, head_dim) gives each head its own weight (Command R's q/k norms)."""

    def __init__(self, shape: int | tuple[int, ...], eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


class CohereLayer(nn.Module):
    def __init__(self, a: CohereArch, window: int | None, rotates: bool) -> None:
        super().__init__()
        self.a = a
        self.window = window
        self.rotates = rotates
        init_projections(self, a, a.attention_bias, a.attention_bias)
        self.input_layernorm = CohereLayerNorm(a.hidden_size, a.layer_norm_eps)
        if a.qk_norm:
            self.q_norm = CohereLayerNorm((a.num_heads, a.head_dim), a.layer_norm_eps)
            self.k_norm = CohereLayerNorm((a.num_kv_heads, a.head_dim), a.layer_norm_eps)
        self.attn_forward = _no_attention_backend

    def forward(self, positions, x, rope: RotaryEmbedding, meta: Any, kv_cache) -> torch.Tensor:
        a = self.a
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if a.qk_norm:
            q = self.q_norm(q.reshape(-1, a.num_heads, a.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, a.num_kv_heads, a.head_dim)).view(-1, self.kv_size)
        if self.rotates:
            rope(positions, q, k)  # in place
        attn = self.attn_forward(
            q.view(-1, a.num_heads, a.head_dim),
            k.view(-1, a.num_kv_heads, a.head_dim),
            v.view(-1, a.num_kv_heads, a.head_dim),
            kv_cache,
            meta,
            1.0 / math.sqrt(a.head_dim),
        )
        out = self.o_proj(attn.reshape(-1, self.q_size))
        return x + out + self.down_proj(ops.silu_and_mul(self.gate_up_proj(h)))


class CohereForCausalLM(nn.Module):
    """Command R / R+ (``CohereForCausalLM``) and Command R7B / A (``Cohere2ForCausalLM``).
    No llama.cpp layout: ``--quantization gguf`` is refused."""

    gguf_layout: ClassVar[Any] = None

    @staticmethod
    def arch_from_hf(hf_config: Any) -> CohereArch:
        return CohereArch.from_hf(hf_config)

    def __init__(self, arch: CohereArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            CohereLayer(arch, w, r)
            for w, r in zip(arch.sliding_windows, arch.rope_layers, strict=True)
        )
        self.norm = CohereLayerNorm(arch.hidden_size, arch.layer_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope, False)
        # EAGLE-3 (spec_decode/eagle.py): the residual stream after each of these many
        # layers, concatenated in ``aux_hidden`` by every forward.
        self.aux_hidden_layers: frozenset[int] = frozenset()
        self.aux_hidden: torch.Tensor | None = None

    @property
    def attention_features(self) -> frozenset[str]:
        return attention_features(self.arch.sliding_windows)

    def set_attention_backend(self, backend: Any) -> None:
        for layer in self.layers:
            layer.attn_forward = layer_attention(backend, sliding_window=layer.window)

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta: Any, kv_caches) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        metas = layer_metadata(meta, len(self.layers))  # the hybrid KV cache's groups
        aux = [x.clone()] if 0 in self.aux_hidden_layers else []
        for i, (layer, kv_cache, m) in enumerate(zip(self.layers, kv_caches, metas, strict=True)):
            x = layer(positions, x, self.rope, m, kv_cache)
            if i + 1 in self.aux_hidden_layers:
                aux.append(x.clone())
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float() * self.arch.logit_scale

    def init_buffers(self) -> None:
        a = self.arch
        weight = self.embed_tokens.weight
        rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope, False)
        self.rope = rope.to(weight.dtype).to(weight.device)
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        self.init_buffers()
        with torch.no_grad():
            load_embeddings_and_head(self, sd)
            for i, layer in enumerate(self.layers):
                p, att = f"layers.{i}.", f"layers.{i}.self_attn."
                bias = self.arch.attention_bias
                load_projections(layer, sd, p, bias, bias)
                layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
                if self.arch.qk_norm:
                    layer.q_norm.weight.copy_(sd[att + "q_norm.weight"])
                    layer.k_norm.weight.copy_(sd[att + "k_norm.weight"])
