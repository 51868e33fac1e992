"""Gemma 4's language model over a flat packed batch (``Gemma4ForCausalLM``, and the text
side of the multimodal ``Gemma4ForConditionalGeneration`` checkpoints).

Gemma 3's layer (``gemma.py``: embeddings scaled by ``sqrt(hidden_size)``, sandwich norms
around attention and the GeLU-tanh MLP, per-head q/k norms, sliding and global layers with
a rotation each, a final logit soft cap), with what transformers' Gemma 4 changes, per
its config:

- norms scale by ``weight`` (not ``1 + weight``: the checkpoint holds the scale itself),
  in fp32; values are RMS-normed per head too (no weight); attention is unscaled (1.0);
- the global (``full_attention``) layers may have their own head size and KV head count
  (transformers' ``per_layer_config``: ``global_head_dim``, ``num_global_key_value_heads``)
  and their own rotation (``proportional``: ``rotary_embedding.py``); with
  ``attention_k_eq_v`` they have no ``v_proj``: the values are the keys' projection,
  before the k norm and the rotation;
- per-layer inputs (``hidden_size_per_layer_input``): a second embedding table
  (``embed_tokens_per_layer``, ``vocab_size_per_layer_input`` rows, one slice per layer,
  scaled by ``sqrt(hidden_size_per_layer_input)``) plus a projection of the embeddings
  (``per_layer_model_projection``, scaled by ``hidden_size ** -0.5``, RMS-normed), the two
  averaged (``* 2 ** -0.5``); after its MLP each layer adds
  ``norm(proj(gelu(gate(x)) * its slice))``;
- KV sharing (``num_kv_shared_layers``): the last layers compute no K/V; each attends
  over the K/V of the last earlier layer of its type (sliding or global) that does;
  with ``use_double_wide_mlp`` their MLP is twice as wide;
- a mixture of experts beside the MLP (``enable_moe_block``): a router over the
  attention's residual stream (RMS-normed without weight, times ``scale`` and
  ``hidden_size ** -0.5``; softmax, top k renormalised, times ``per_expert_scale``) and
  GeLU-tanh experts over its own pre-norm; the MLP's and the experts' outputs are each
  post-normed, summed, and post-normed again;
- each layer's output multiplied by its ``layer_scalar``.

The KV cache. Each cache layer caches its own ``(num_kv_heads, head_dim)``
(``Gemma4Arch.layer_kv_shapes``): the runner gives each layer a tensor of its shape, all
of the pool's number of blocks (model_runner.py's ``plan_kv_tensors``), so gemma-4-E2B's
sliding layers cache 256-wide heads, not its global layers' 512. Where the hybrid KV
cache shares a tensor between a sliding and a global layer and one tensor of the larger
heads costs fewer bytes than one of each shape (E2B's: 512 < 256 + 512; not the 31B's
16 x 256 sliding and 4 x 512 global heads), the smaller layer gets the larger tensor and
pads to its shape: q, k and v zero-padded to its head size (the dot products and the
first ``head_dim`` of the outputs unchanged, the padding sliced off), k and v's heads
repeated to its KV head count (the query heads' grouping unchanged). Each layer attends
with a backend instance of its tensor's shape (``ShapedAttention``: TORCH_FLASH_ATTN
scales and groups queries by its instance's sizes). The KV-shared layers have no cache:
the arch counts only the layers that compute K/V (``num_layers``, ``sliding_windows``),
and a shared layer attends through its source's cache and metadata, handing the backend
its source's K/V of the step again (rewriting the same values at the same slots: the
backends' ``forward`` always writes).

Multimodal checkpoints (``Gemma4ForConditionalGeneration``) take images when their
config has a ``vision_config`` (``gemma4_vision.py``: the tower at each image's own size,
pooled and projected by ``embed_vision``); the prompt names an image with its image token,
which becomes ``boi``, one image token per row of the image, ``eoi`` (transformers'
``Gemma4Processor``; vllm/multimodal/processing.py's "framed_patches"), the rows written
over the image tokens' embeddings. Audio and video are refused (the engine takes images
only); the audio tower's tensors are never read (``checkpoint_prefixes``). The image,
video and audio token ids embed as ``pad_token_id`` (an image's rows then replace them),
also in the per-layer inputs' table, as transformers embeds them.
``use_bidirectional_attention`` "vision": each image's tokens attend to each other both
ways in the sliding layers only (transformers' ``create_masks_for_vision_model``: the
global layers stay causal), so a global layer attends with the step's metadata less its
spans (``causal_metadata``); "all" (an encoder) is refused.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts
from vllm.model_executor.layers.rotary_embedding import max_positions, rope_parameters
from vllm.model_executor.models.llama import (
    RotaryEmbedding,
    _no_attention_backend,
    attention_features,
    layer_attention,
)
from vllm.model_executor.models.moe import stacked_experts
from vllm.model_executor.models.utils import (
    LANGUAGE_MODEL_PREFIXES,
    LM_HEAD_KEYS,
    language_model_tensors,
    takes_images,
)
from vllm.v1.attention.backends.abstract import layer_metadata

# hidden_activation values transformers computes as GeLU's tanh approximation (its "gelu"
# is the exact GeLU here, unlike Gemma 1's reading: refused).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new")
# The per-layer config fields transformers' Gemma 4 varies by layer (its attention reads
# them per layer); any other per-layer field is refused.
_PER_LAYER_FIELDS = frozenset({"head_dim", "num_key_value_heads"})


@dataclass(frozen=True)
class Gemma4Arch:
    hidden_size: int
    num_hidden_layers: int  # decoder layers
    num_heads: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int  # the rotary tables' length
    layer_types: tuple[str, ...]  # per decoder layer: sliding_attention or full_attention
    layer_head_dims: tuple[int, ...]
    layer_kv_heads: tuple[int, ...]
    layer_windows: tuple[int | None, ...]  # per decoder layer
    kv_source: tuple[int, ...]  # per decoder layer: the layer whose K/V it attends over
    rope_local: dict[str, Any]  # rotary_embedding.rope_parameters' dicts
    rope_global: dict[str, Any]
    final_logit_softcapping: float | None = None
    attention_bias: bool = False
    attention_k_eq_v: bool = False
    use_double_wide_mlp: bool = False
    per_layer_dim: int = 0  # hidden_size_per_layer_input (0: no per-layer inputs)
    per_layer_vocab: int = 0
    num_experts: int = 0  # 0: no MoE block
    top_k: int = 0
    moe_intermediate_size: int = 0
    pad_token_id: int = 0
    media_token_ids: tuple[int, ...] = ()  # a multimodal checkpoint's: embedded as pad
    # A multimodal checkpoint with a vision_config: its tower's arch (gemma4_vision.py's
    # Gemma4VisionArch), and whether an image's tokens attend to each other both ways in
    # the sliding layers (use_bidirectional_attention "vision").
    vision: Any = None
    bidirectional_images: bool = False

    # What the runner sizes the KV cache and the backend by: the cache layers (those that
    # compute K/V: the first num_layers decoder layers), each of its own shape
    # (layer_kv_shapes); the backend is built for the largest head and KV head count.
    @property
    def num_layers(self) -> int:
        return sum(1 for i, src in enumerate(self.kv_source) if src == i)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        return self.layer_windows[: self.num_layers]

    @property
    def head_dim(self) -> int:
        return max(self.layer_head_dims)

    @property
    def num_kv_heads(self) -> int:
        return max(self.layer_kv_heads)

    @property
    def layer_kv_shapes(self) -> tuple[tuple[int, int], ...]:
        """Each cache layer's ``(num_kv_heads, head_dim)`` (the KV-shared layers, which
        cache nothing, are the last ones)."""
        return tuple(zip(self.layer_kv_heads, self.layer_head_dims, strict=True))[: self.num_layers]

    def shares_kv(self, layer: int) -> bool:
        return self.kv_source[layer] != layer

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def mlp_size(self, layer: int) -> int:
        wide = self.use_double_wide_mlp and self.shares_kv(layer)
        return self.intermediate_size * (2 if wide else 1)

    @classmethod
    def from_hf(
        cls, config: Any, media_token_ids: tuple[int, ...] = (), vision: Any = None
    ) -> Gemma4Arch:
        """The arch of a ``Gemma4TextConfig`` (with ``vision``, a multimodal checkpoint's
        tower arch); ``ValueError`` naming a field it cannot serve."""
        from vllm.model_executor.model_loader import layer_sliding_windows

        if config.model_type != "gemma4_text":
            raise ValueError(f"model_type {config.model_type!r} is not Gemma 4's text model")
        act = getattr(config, "hidden_activation", None)
        if act not in _GELU_TANH:
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        bidirectional = getattr(config, "use_bidirectional_attention", None)
        if bidirectional not in (None, "vision"):
            raise ValueError(
                f"use_bidirectional_attention {bidirectional!r} is not supported (every token "
                "attending both ways: an encoder); None and 'vision' (images) are served"
            )
        extra = set(getattr(config, "per_layer_attributes", None) or ()) - _PER_LAYER_FIELDS
        if extra:
            raise ValueError(f"per_layer_config varies {sorted(extra)} by layer: not supported")
        n = config.num_hidden_layers
        types = tuple(config.layer_types)
        if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types {list(types)}: {n} of sliding/full_attention")
        per_layer = [config.per_layer_config[i] for i in range(n)]
        heads = config.num_attention_heads
        head_dims = tuple(int(c.head_dim) for c in per_layer)
        kv_heads = tuple(int(c.num_key_value_heads) for c in per_layer)
        top_kv = max(kv_heads)
        for i, k in enumerate(kv_heads):
            if heads % top_kv or top_kv % k:
                raise ValueError(
                    f"layer {i}: {k} KV heads do not divide the largest layer's {top_kv}, or "
                    f"those the {heads} query heads"
                )
        shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
        if not 0 <= shared < n:
            raise ValueError(f"num_kv_shared_layers {shared}: 0 to {n - 1} of {n} layers")
        first_shared = n - shared
        source = list(range(n))
        for i in range(first_shared, n):
            own = [j for j in range(first_shared) if types[j] == types[i]]
            if not own:
                raise ValueError(
                    f"num_kv_shared_layers {shared}: no earlier {types[i]} layer computes "
                    f"the K/V layer {i} would share"
                )
            source[i] = own[-1]
        moe = bool(getattr(config, "enable_moe_block", False))
        if moe and not (config.num_experts and config.top_k_experts and
                        config.moe_intermediate_size):  # fmt: skip
            raise ValueError(
                "enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size"
            )
        per_layer_dim = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        per_layer_vocab = int(getattr(config, "vocab_size_per_layer_input", 0) or 0)
        if per_layer_dim and per_layer_vocab < config.vocab_size:
            raise ValueError(
                f"vocab_size_per_layer_input {per_layer_vocab} is smaller than vocab_size "
                f"{config.vocab_size}: a token would have no per-layer input"
            )
        rope_global = rope_parameters(config, "full_attention")
        rope_local = rope_parameters(config, "sliding_attention")
        pad = getattr(config, "pad_token_id", None)
        return cls(
            hidden_size=config.hidden_size,
            num_hidden_layers=n,
            num_heads=heads,
            vocab_size=config.vocab_size,
            intermediate_size=config.intermediate_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            max_position_embeddings=max(
                max_positions(config.max_position_embeddings, rope_global),
                max_positions(config.max_position_embeddings, rope_local),
            ),
            layer_types=types,
            layer_head_dims=head_dims,
            layer_kv_heads=kv_heads,
            layer_windows=layer_sliding_windows(config),
            kv_source=tuple(source),
            rope_local=rope_local,
            rope_global=rope_global,
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            attention_k_eq_v=bool(getattr(config, "attention_k_eq_v", False)),
            use_double_wide_mlp=bool(getattr(config, "use_double_wide_mlp", False)),
            per_layer_dim=per_layer_dim,
            per_layer_vocab=per_layer_vocab if per_layer_dim else 0,
            num_experts=config.num_experts if moe else 0,
            top_k=config.top_k_experts if moe else 0,
            moe_intermediate_size=config.moe_intermediate_size if moe else 0,
            pad_token_id=0 if pad is None else int(pad),
            media_token_ids=media_token_ids,
            vision=vision,
            bidirectional_images=vision is not None and bidirectional == "vision",
        )


def causal_metadata(meta: Any) -> Any:
    """A step's attention metadata with every row causal (the global layers'): the
    backend's own ``causal()`` copy where its metadata takes ``bidirectional_spans``,
    else ``meta`` itself (no spans can be in it)."""
    causal = getattr(meta, "causal", None)
    return meta if causal is None else causal()


class ShapedAttention:
    """A layer's ``attn_forward``: the model's backend ``forward`` (its window bound) by an
    instance sized for the cache tensor it is handed, ``(num_kv_heads, head_dim)`` from
    its shape: the backend the runner built (of the largest shape), or a shallow copy of
    it with those sizes, made on first use and shared by every layer of that shape. The
    torch backends read the sizes from the tensors except TORCH_FLASH, which scales
    (a kernel without a scale argument) and groups queries (without GQA) by its
    instance's ``head_size`` and ``num_kv_heads``; the step's metadata does not depend
    on them (built once, by the runner's instance)."""

    def __init__(self, backend: Any, window: int | None, instances: dict) -> None:
        self.backend = backend
        self.window = window
        self.instances = instances  # (num_kv_heads, head_dim) -> backend instance
        self._forwards: dict[tuple[int, int], Any] = {}

    def _forward(self, shape: tuple[int, int]) -> Any:
        fn = self._forwards.get(shape)
        if fn is None:
            instance = self.instances.get(shape)
            if instance is None:
                instance = copy.copy(self.backend)
                instance.num_kv_heads, instance.head_size = shape
                self.instances[shape] = instance
            fn = self._forwards[shape] = layer_attention(instance, sliding_window=self.window)
        return fn

    def __call__(self, q, k, v, kv_cache, meta, scale, **features) -> torch.Tensor:
        shape = (kv_cache.shape[-2], kv_cache.shape[-1])
        return self._forward(shape)(q, k, v, kv_cache, meta, scale, **features)


class Gemma4RMSNorm(nn.Module):
    """``x / rms(x) * weight`` in fp32, returned in x's dtype; ``scale`` False: no weight
    (the values' norm, the router's)."""

    def __init__(self, dim: int, eps: float, scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.to(x.dtype)


def gelu_tanh_and_mul(h: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of ``h = [gate | up]``: the MLP's and the experts' gate."""
    gate, up = h.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Gemma4Router(nn.Module):
    """(tokens, hidden) residual stream -> (weights fp32, expert ids), each (tokens, k)."""

    def __init__(self, a: Gemma4Arch) -> None:
        super().__init__()
        self.norm = Gemma4RMSNorm(a.hidden_size, a.rms_norm_eps, scale=False)
        self.proj = nn.Linear(a.hidden_size, a.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(a.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(a.num_experts))
        self.top_k = a.top_k
        self.root = a.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(self.norm(x) * self.scale * self.root)
        weights, ids = select_experts(logits, self.top_k, renormalize=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Layer(nn.Module):
    def __init__(self, a: Gemma4Arch, index: int) -> None:
        super().__init__()
        self.a = a
        self.index = index
        self.head_dim = a.layer_head_dims[index]
        self.kv_heads = a.layer_kv_heads[index]
        self.window = a.layer_windows[index]
        self.shared = a.shares_kv(index)
        # Some KV-shared layer attends over this layer's K/V of the step.
        self.is_source = any(src == index != j for j, src in enumerate(a.kv_source))
        # Global layers with attention_k_eq_v take their values from the keys' projection.
        self.values_are_keys = a.attention_k_eq_v and not a.is_sliding(index)
        self.q_size = a.num_heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        parts = [self.q_size]
        if not self.shared:
            parts += [self.kv_size] if self.values_are_keys else [self.kv_size, self.kv_size]
        self.parts = parts
        eps = a.rms_norm_eps
        self.qkv_proj = nn.Linear(a.hidden_size, sum(parts), bias=a.attention_bias)
        self.o_proj = nn.Linear(self.q_size, a.hidden_size, bias=a.attention_bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if not self.shared:
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, scale=False)
        size = a.mlp_size(index)
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, a.hidden_size, bias=False)
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # fmt: skip
            setattr(self, name, Gemma4RMSNorm(a.hidden_size, eps))
        if a.num_experts:
            self.router = Gemma4Router(a)
            self.experts = FusedMoE(
                a.num_experts, a.top_k, a.hidden_size, a.moe_intermediate_size,
                renormalize=True, activation=gelu_tanh_and_mul,
            )  # fmt: skip
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):  # fmt: skip
                setattr(self, name, Gemma4RMSNorm(a.hidden_size, eps))
        if a.per_layer_dim:
            self.per_layer_input_gate = nn.Linear(a.hidden_size, a.per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(a.per_layer_dim, a.hidden_size, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(a.hidden_size, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.attn_forward = _no_attention_backend

    def _to_cache_shape(
        self, t: torch.Tensor, cache: torch.Tensor, kv: bool = True
    ) -> torch.Tensor:
        """(tokens, heads, head_dim) -> the ``cache`` tensor's head size (zero-padded) and,
        for k and v (``kv``), its KV head count (each head repeated): unchanged when the
        cache has the layer's own shape (the module docstring)."""
        heads, dim = cache.shape[-2], cache.shape[-1]
        if kv and t.shape[1] != heads:
            t = t.repeat_interleave(heads // t.shape[1], dim=1)
        if t.shape[-1] != dim:
            t = F.pad(t, (0, dim - t.shape[-1]))
        return t

    def attention(self, positions, h, rope, meta, kv_cache, shared) -> torch.Tensor:
        """o_proj(attention(h)); ``shared``: this step's cache-shaped (k, v) by layer, read
        by a KV-shared layer, written by its source."""
        a, d = self.a, self.head_dim
        q, *kv = self.qkv_proj(h).split(self.parts, dim=-1)
        q = self.q_norm(q.reshape(-1, a.num_heads, d)).view(-1, self.q_size)
        if self.shared:
            k, v = shared[a.kv_source[self.index]]
            rope(positions, q, q[:, :d].clone())  # q alone turns (a one-head stand-in k)
        else:
            k = kv[0]
            v = k if self.values_are_keys else kv[1]
            v = self.v_norm(v.reshape(-1, self.kv_heads, d))
            k = self.k_norm(k.reshape(-1, self.kv_heads, d)).view(-1, self.kv_size)
            rope(positions, q, k)  # in place
            k = self._to_cache_shape(k.view(-1, self.kv_heads, d), kv_cache)
            v = self._to_cache_shape(v, kv_cache)
            if self.is_source:
                shared[self.index] = (k, v)
        q = self._to_cache_shape(q.view(-1, a.num_heads, d), kv_cache, kv=False)
        out = self.attn_forward(q, k, v, kv_cache, meta, 1.0)
        if out.shape[-1] != d:
            out = out[..., :d]
        return self.o_proj(out.reshape(-1, self.q_size))

    def forward(self, positions, x, per_layer_input, rope, meta, kv_cache, shared):
        h = self.attention(positions, self.input_layernorm(x), rope, meta, kv_cache, shared)
        x = x + self.post_attention_layernorm(h)
        out = self.down_proj(
            gelu_tanh_and_mul(self.gate_up_proj(self.pre_feedforward_layernorm(x)))
        )
        if self.a.num_experts:
            weights, ids = self.router(x)
            moe = self.experts.apply(self.pre_feedforward_layernorm_2(x), weights, ids)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(moe)
        x = x + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4ForCausalLM(nn.Module):
    """Gemma 4's text models (``Gemma4ForCausalLM``; module docstring). No llama.cpp
    layout: ``--quantization gguf`` is refused."""

    gguf_layout: ClassVar[Any] = None
    supports_images: ClassVar[bool] = False

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Gemma4Arch:
        return Gemma4Arch.from_hf(hf_config)

    def __init__(self, arch: Gemma4Arch) -> None:
        super().__init__()
        a = self.arch = arch
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Gemma4Layer(a, i) for i in range(a.num_hidden_layers))
        self.norm = Gemma4RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        if a.per_layer_dim:
            width = a.num_hidden_layers * a.per_layer_dim
            self.embed_tokens_per_layer = nn.Embedding(a.per_layer_vocab, width)
            self.per_layer_model_projection = nn.Linear(a.hidden_size, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(a.per_layer_dim, a.rms_norm_eps)
        self.register_buffer("media_ids", torch.tensor(a.media_token_ids, dtype=torch.long))
        self._make_ropes()

    def _make_ropes(self, dtype=None, device=None) -> None:
        a = self.arch
        for name, kind, params in (("rope_local", "sliding_attention", a.rope_local),
                                   ("rope_global", "full_attention", a.rope_global)):  # fmt: skip
            dims = [d for d, t in zip(a.layer_head_dims, a.layer_types, strict=True) if t == kind]
            rope = RotaryEmbedding(dims[0] if dims else a.head_dim, a.max_position_embeddings,
                                   params)  # fmt: skip
            setattr(self, name, rope if dtype is None else rope.to(dtype).to(device))

    @property
    def attention_features(self) -> frozenset[str]:
        return attention_features(self.arch.layer_windows)

    def set_attention_backend(self, backend: Any) -> None:
        instances = {(backend.num_kv_heads, backend.head_size): backend}  # one per shape
        for layer in self.layers:
            layer.attn_forward = ShapedAttention(backend, layer.window, instances)

    def _text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.arch.media_token_ids:
            return input_ids
        media = torch.isin(input_ids, self.media_ids)
        return torch.where(media, self.arch.pad_token_id, input_ids)

    @torch.inference_mode()
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) ids -> (num_tokens, hidden): the embeddings times
        ``sqrt(hidden_size)`` (rounded to the weights' dtype first, as transformers)."""
        x = self.embed_tokens(self._text_ids(input_ids))
        return x * torch.tensor(math.sqrt(self.arch.hidden_size), dtype=x.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(num_tokens, layers, per_layer_dim): each layer's input beside the stream."""
        a = self.arch
        shape = (-1, a.num_hidden_layers, a.per_layer_dim)
        table = self.embed_tokens_per_layer(self._text_ids(input_ids))
        table = table * torch.tensor(math.sqrt(a.per_layer_dim), dtype=table.dtype)
        proj = self.per_layer_model_projection(x) * a.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.reshape(shape))
        return (proj + table.reshape(shape)) * 2**-0.5

    @torch.inference_mode()
    def forward(
        self, input_ids, positions, meta: Any, kv_caches, inputs_embeds=None
    ) -> torch.Tensor:
        """(num_tokens,) ids -> (num_tokens, hidden) final hidden states; ``kv_caches``
        and ``meta``: the cache layers' (``Gemma4Arch.num_layers``)."""
        a = self.arch
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = self.per_layer_inputs(input_ids, x) if a.per_layer_dim else None
        metas = layer_metadata(meta, a.num_layers)
        if a.bidirectional_images:  # the global layers stay causal (module docstring)
            causal: dict[int, Any] = {}  # id -> its causal copy, one per metadata object
            metas = list(metas)  # not the step's GroupedMetadata.layers
            for c, m in enumerate(metas):
                if not a.is_sliding(c):
                    if id(m) not in causal:
                        causal[id(m)] = causal_metadata(m)
                    metas[c] = causal[id(m)]
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            c = a.kv_source[i]
            rope = self.rope_local if a.is_sliding(i) else self.rope_global
            ple = per_layer[:, i] if per_layer is not None else None
            x = layer(positions, x, ple, rope, metas[c], kv_caches[c], shared)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def init_buffers(self) -> None:
        weight = self.embed_tokens.weight
        self._make_ropes(weight.dtype, weight.device)
        with torch.no_grad():
            self.media_ids.copy_(torch.tensor(self.arch.media_token_ids, dtype=torch.long))
            for layer in self.layers:
                layer.layer_scalar.fill_(1.0)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy the checkpoint's tensors in (q/k/v and gate/up fused), after
        ``init_buffers``; a KV-shared layer's k/v tensors, where saved, are not read."""
        a = self.arch
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        self.init_buffers()
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
            self.norm.weight.copy_(sd["norm.weight"])
            if not a.tie_word_embeddings:
                self.lm_head.weight.copy_(sd.get("lm_head.weight", sd["embed_tokens.weight"]))
            if a.per_layer_dim:
                for name in ("embed_tokens_per_layer", "per_layer_model_projection",
                             "per_layer_projection_norm"):  # fmt: skip
                    getattr(self, name).weight.copy_(sd[name + ".weight"])
            for i, layer in enumerate(self.layers):
                self._load_layer(layer, sd, f"layers.{i}.")

    def _load_layer(self, layer: Gemma4Layer, sd: dict[str, torch.Tensor], p: str) -> None:
        a, att = self.arch, p + "self_attn."
        names = ["q_proj"]
        if not layer.shared:
            names += ["k_proj"] if layer.values_are_keys else ["k_proj", "v_proj"]
        layer.qkv_proj.weight.copy_(torch.cat([sd[f"{att}{n}.weight"] for n in names]))
        layer.o_proj.weight.copy_(sd[att + "o_proj.weight"])
        if a.attention_bias:
            layer.qkv_proj.bias.copy_(torch.cat([sd[f"{att}{n}.bias"] for n in names]))
            layer.o_proj.bias.copy_(sd[att + "o_proj.bias"])
        norms = {"q_norm": att + "q_norm"}
        if not layer.shared:
            norms["k_norm"] = att + "k_norm"
        for name in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # fmt: skip
            norms[name] = p + name
        if a.num_experts:
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):  # fmt: skip
                norms[name] = p + name
        if a.per_layer_dim:
            norms["post_per_layer_input_norm"] = p + "post_per_layer_input_norm"
            layer.per_layer_input_gate.weight.copy_(sd[p + "per_layer_input_gate.weight"])
            layer.per_layer_projection.weight.copy_(sd[p + "per_layer_projection.weight"])
        for name, key in norms.items():
            getattr(layer, name).weight.copy_(sd[key + ".weight"])
        mlp = p + "mlp."
        gate_up = torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]])
        layer.gate_up_proj.weight.copy_(gate_up)
        layer.down_proj.weight.copy_(sd[mlp + "down_proj.weight"])
        if p + "layer_scalar" in sd:
            layer.layer_scalar.copy_(sd[p + "layer_scalar"].reshape(1))
        if a.num_experts:
            router = layer.router
            router.proj.weight.copy_(sd[p + "router.proj.weight"])
            router.scale.copy_(sd[p + "router.scale"])
            router.per_expert_scale.copy_(sd[p + "router.per_expert_scale"])
            e, i, h = a.num_experts, a.moe_intermediate_size, a.hidden_size
            gate_up = stacked_experts(sd, p + "experts.gate_up_proj", (e, 2 * i, h))
            down = stacked_experts(sd, p + "experts.down_proj", (e, h, i))
            for n in range(e):
                layer.experts.load_expert(n, gate_up[n, :i], gate_up[n, i:], down[n])


# The most image tokens one image takes: the largest max_soft_tokens transformers'
# Gemma4ImageProcessor accepts (70, 140, 280, 560 or 1120; 280 by default).
MAX_IMAGE_TOKENS = 1120


@dataclass(frozen=True)
class ImageFrameLayout:
    """How Gemma 4 frames an image in a prompt: the prompt names it with ``image_token_id``
    (``<|image|>``); the processor turns that into ``boi_token_id``, as many
    ``image_token_id`` as the image has rows (its patches pooled), ``eoi_token_id``
    (transformers' ``Gemma4Processor.replace_image_token``), of which only the image
    tokens take the image's embeddings."""

    boi_token_id: int
    image_token_id: int
    eoi_token_id: int


def image_frame_layout(hf_config: Any) -> ImageFrameLayout:
    """The image layout of a Gemma 4 config (transformers' ``Gemma4Config``)."""
    return ImageFrameLayout(
        boi_token_id=int(hf_config.boi_token_id),
        image_token_id=int(hf_config.image_token_id),
        eoi_token_id=int(hf_config.eoi_token_id),
    )


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """Gemma 4's multimodal checkpoints (module docstring): the language model of
    ``text_config`` and, with a ``vision_config``, the vision tower and its embedder
    (``vision_tower``: gemma4_vision.py) taking images; the audio tower's tensors are not
    read."""

    # The prompt frames each image; its patches come at its own size, with their grid
    # (vllm/multimodal/processing.py's "framed_patches").
    image_layout: ClassVar[str] = "framed_patches"
    supports_images: ClassVar[bool] = True

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Gemma4Arch:
        from vllm.model_executor.models.gemma4_vision import Gemma4VisionArch

        media = tuple(
            int(t)
            for t in (
                getattr(hf_config, f"{m}_token_id", None) for m in ("image", "video", "audio")
            )
            if t is not None
        )
        text = hf_config.get_text_config()
        vision = getattr(hf_config, "vision_config", None)
        if vision is not None:
            if getattr(hf_config, "image_token_id", None) is None:
                raise ValueError("a vision_config without an image_token_id")
            vision = Gemma4VisionArch.from_hf(vision, text.hidden_size)
        return Gemma4Arch.from_hf(text, media, vision)

    @staticmethod
    def takes_images(hf_config: Any) -> bool:
        return takes_images(hf_config)

    @staticmethod
    def checkpoint_prefixes(hf_config: Any) -> tuple[str, ...]:
        """The language model's tensors, and with a vision_config the vision tower's and
        its embedder's (the loader reads no others: not the audio tower's)."""
        from vllm.model_executor.models.gemma4_vision import EMBEDDER_PREFIX, TOWER_PREFIX

        vision = (TOWER_PREFIX, EMBEDDER_PREFIX) if takes_images(hf_config) else ()
        return LANGUAGE_MODEL_PREFIXES + LM_HEAD_KEYS + vision

    def __init__(self, arch: Gemma4Arch) -> None:
        from vllm.model_executor.models.gemma4_vision import Gemma4VisionModel

        super().__init__(arch)
        if arch.vision is not None:
            self.vision_tower = Gemma4VisionModel(arch.vision)
        # Each image's tokens attend to each other both ways in the sliding layers; the
        # model runner marks their spans for the backend (Gemma 3's way).
        self.bidirectional_image_attention = arch.bidirectional_images

    @property
    def attention_features(self) -> frozenset[str]:
        features = super().attention_features
        return features | {"bidirectional_spans"} if self.arch.bidirectional_images else features

    @property
    def max_image_tokens(self) -> int:
        """The most tokens one image's embeddings take (a prefill chunk must hold them all
        when they attend both ways): ``MAX_IMAGE_TOKENS``."""
        return MAX_IMAGE_TOKENS

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The images' patches concatenated ((patches, 3 * patch_size ** 2), any float
        dtype, any device) and their (images, 3) grids (1, height, width) -> each image's
        rows concatenated, (rows, hidden) in the model's dtype on its device: to be written
        over the image tokens' embeddings (transformers scatters them after the scaling)."""
        if self.arch.vision is None:
            raise ValueError("this Gemma 4 checkpoint has no vision_config: it takes no images")
        return self.vision_tower(pixel_values, grid_thw)

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        super().load_weights(language_model_tensors(sd))
        if self.arch.vision is not None:
            self.vision_tower.load_weights(sd)
