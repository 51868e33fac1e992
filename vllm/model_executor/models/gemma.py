"""The Gemma family (Gemma, Gemma 2, Gemma 3 with its images) over a flat packed batch.

Llama's shape (``llama.py``: fused q/k/v and gate/up projections, a paged KV cache through
the attention backend) with Gemma's differences, as transformers computes them:

- embeddings scaled by ``sqrt(hidden_size)`` (rounded to the weights' dtype), output head
  tied to them;
- RMS norms that scale by ``1 + weight`` in fp32 (``GemmaRMSNorm``), the checkpoint holding
  the offset from 1;
- a GeLU (tanh approximation) gated MLP;
- Gemma 2 and 3: a norm after attention and around the MLP ("sandwich" norms), attention
  scaled by ``query_pre_attn_scalar ** -0.5``, and every other (Gemma 2) or five of six
  (Gemma 3) layers attending to a sliding window (``layer_types``);
- Gemma 2: attention scores and final logits soft-capped (``cap * tanh(x / cap)``);
- Gemma 3: q and k RMS-normalised per head, and two rotations: the sliding layers' (theta
  10,000) and the global layers' (theta 1,000,000, with its scaling).

The windows and the soft cap are attention features (``AttentionBackend.supported_features``):
the selector installs a backend that has them (the torch backend; docs/models.md).

Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) add a SigLIP vision
tower (``siglip_vision.py``) and a projector. An image of the tower's size becomes
``mm_tokens_per_image`` rows (``embed_images``): the tower's last hidden state, its patch
grid average-pooled down to ``sqrt(mm_tokens_per_image)`` a side, Gemma-RMS-normed
(``mm_soft_emb_norm``) and multiplied by ``mm_input_projection_weight``. The prompt frames
each image (``image_frame_layout``); the engine writes the image's rows over its
``image_token_id`` rows of ``embed_input_ids`` (already scaled: transformers scatters them
after the scaling) and runs the language model on the result (``forward(...,
inputs_embeds=...)``); each image's tokens attend to each other both ways (the
``bidirectional_spans`` feature). Tensors: the Hub's layout (``vision_tower.vision_model.``,
``multi_modal_projector.``, ``language_model.model.``), the one transformers 5 saves (the
tower's without ``vision_model.``) and the one it holds in memory (``model.vision_tower.``,
``model.multi_modal_projector.``, ``model.language_model.``, ``lm_head``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

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
from vllm.model_executor.models.siglip_vision import SiglipVisionArch, SiglipVisionModel
from vllm.model_executor.models.utils import (
    config_from_dict,
    language_model_tensors,
    takes_images,
)
from vllm.v1.attention.backends.abstract import layer_metadata

# hidden_activation / hidden_act values that mean GeLU's tanh approximation (Gemma 1's
# configs say "gelu" and mean it, as transformers reads them).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")
# Where Gemma 3's multimodal checkpoints keep the tower's and the projector's tensors (each
# also under ``model.``, as transformers 5 holds them in memory).
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True)
class GemmaArch:
    family: str  # "gemma", "gemma2" or "gemma3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int  # the rotary tables' length
    tie_word_embeddings: bool
    scale: float  # of the attention scores
    sliding_windows: tuple[int | None, ...]
    sliding_layers: tuple[bool, ...]  # typed sliding_attention: they rotate by rope_local
    rope_global: dict[str, Any]  # rotary_embedding.rope_parameters' dicts
    rope_local: dict[str, Any]  # the sliding layers' (Gemma 3); else rope_global
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    attention_bias: bool = False

    @property
    def sandwich_norms(self) -> bool:
        return self.family != "gemma"

    @property
    def qk_norm(self) -> bool:
        return self.family == "gemma3"

    @classmethod
    def from_hf(cls, config) -> GemmaArch:
        from vllm.model_executor.model_loader import layer_sliding_windows, sliding_layer_types

        family = config.model_type.removesuffix("_text")
        if family not in ("gemma", "gemma2", "gemma3"):
            raise ValueError(f"model_type {config.model_type!r} is not a Gemma text model")
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act not in _GELU_TANH:
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (an embedding model) is not supported")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        rope_global = rope_parameters(config, "full_attention")
        rope_local = rope_parameters(config, "sliding_attention")
        scalar = getattr(config, "query_pre_attn_scalar", None) if family != "gemma" else None
        return cls(
            family=family,
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=max(
                max_positions(config.max_position_embeddings, rope_global),
                max_positions(config.max_position_embeddings, rope_local),
            ),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
            scale=(scalar or head_dim) ** -0.5,
            sliding_windows=layer_sliding_windows(config),
            sliding_layers=sliding_layer_types(config) or (False,) * config.num_hidden_layers,
            rope_global=rope_global,
            rope_local=rope_local,
            attn_logit_softcapping=getattr(config, "attn_logit_softcapping", None),
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
            attention_bias=bool(getattr(config, "attention_bias", False)),
        )


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + weight)``, computed in fp32 and returned in x's dtype (the weight
    stays the checkpoint's offset from 1: adding 1 in bf16 would round most of it away)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GemmaLayer(nn.Module):
    def __init__(self, a: GemmaArch, window: int | None) -> None:
        super().__init__()
        self.a = a
        self.window = window
        init_projections(self, a, a.attention_bias, a.attention_bias)
        self.input_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(a.hidden_size, a.rms_norm_eps)
        if a.qk_norm:
            self.q_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(a.head_dim, a.rms_norm_eps)
        self.attn_forward = _no_attention_backend

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        meta: Any,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        a = self.a
        h = self.input_layernorm(x)
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if a.qk_norm:  # per-head norms with their own weights, before the rotation
            q = self.q_norm(q.reshape(-1, a.num_heads, a.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, a.num_kv_heads, a.head_dim)).view(-1, self.kv_size)
        rope(positions, q, k)  # in place
        attn = self.attn_forward(
            q.view(-1, a.num_heads, a.head_dim),
            k.view(-1, a.num_kv_heads, a.head_dim),
            v.view(-1, a.num_kv_heads, a.head_dim),
            kv_cache,
            meta,
            a.scale,
        )
        out = self.o_proj(attn.reshape(-1, self.q_size))
        if a.sandwich_norms:
            x = x + self.post_attention_layernorm(out)
            h = self.pre_feedforward_layernorm(x)
        else:
            x = x + out
            h = self.post_attention_layernorm(x)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        out = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if a.sandwich_norms:
            out = self.post_feedforward_layernorm(out)
        return x + out


class GemmaForCausalLM(nn.Module):
    """Gemma (``GemmaForCausalLM``), Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3's text
    models (``Gemma3ForCausalLM``: gemma-3-1b, or the text tower of a larger checkpoint
    saved on its own). No llama.cpp layout: ``--quantization gguf`` is refused."""

    gguf_layout: ClassVar[Any] = None

    @staticmethod
    def arch_from_hf(hf_config: Any) -> GemmaArch:
        return GemmaArch.from_hf(hf_config)

    @staticmethod
    def check_dtype(hf_config: Any, dtype: torch.dtype) -> None:
        """Gemma 2 and 3 overflow float16 (their activations grow past 65,504), as vLLM
        refuses them: ``ValueError`` naming the dtypes that work."""
        if dtype == torch.float16 and hf_config.model_type.startswith(("gemma2", "gemma3")):
            raise ValueError(
                f"dtype float16 is not supported for {hf_config.model_type} (numerical "
                "instability); use bfloat16 or float32"
            )

    def __init__(self, arch: GemmaArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(arch, w) for w in arch.sliding_windows)
        self._local = arch.sliding_layers
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope_global = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_global
        )
        self.rope_local = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_local
        )
        # EAGLE-3 (spec_decode/eagle.py): the residual stream after each of these many
        # layers, concatenated in ``aux_hidden`` by every forward.
        self.aux_hidden_layers: frozenset[int] = frozenset()
        self.aux_hidden: torch.Tensor | None = None

    @property
    def attention_features(self) -> frozenset[str]:
        return attention_features(self.arch.sliding_windows, self.arch.attn_logit_softcapping)

    def set_attention_backend(self, backend: Any) -> None:
        for layer in self.layers:
            layer.attn_forward = layer_attention(
                backend,
                sliding_window=layer.window,
                logits_soft_cap=self.arch.attn_logit_softcapping,
            )

    @torch.inference_mode()
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) ids -> (num_tokens, hidden): the embeddings the first layer reads,
        times ``sqrt(hidden_size)``; a new tensor."""
        x = self.embed_tokens(input_ids)
        # transformers rounds the scale to the weights' dtype first (bf16: 8 bits).
        return x * torch.tensor(math.sqrt(self.arch.hidden_size), dtype=x.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids,
        positions,
        meta: Any,
        kv_caches,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(num_tokens,) ids -> (num_tokens, hidden) final hidden states. ``inputs_embeds``
        (num_tokens, hidden), when given, is read instead of ``embed_input_ids(input_ids)``
        (Gemma 3's: image rows written over its placeholders' rows); it is not modified."""
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        metas = layer_metadata(meta, len(self.layers))  # the hybrid KV cache's groups
        aux = [x.clone()] if 0 in self.aux_hidden_layers else []
        for i, (layer, kv_cache, local, m) in enumerate(
            zip(self.layers, kv_caches, self._local, metas, strict=True)
        ):
            rope = self.rope_local if local else self.rope_global
            x = layer(positions, x, rope, m, kv_cache)
            if i + 1 in self.aux_hidden_layers:
                aux.append(x.clone())
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def init_buffers(self) -> None:
        a = self.arch
        weight = self.embed_tokens.weight
        for name, params in (("rope_global", a.rope_global), ("rope_local", a.rope_local)):
            rope = RotaryEmbedding(a.head_dim, a.max_position_embeddings, params)
            setattr(self, name, rope.to(weight.dtype).to(weight.device))
        if a.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy HF checkpoint tensors in, fusing q/k/v and gate/up, after ``init_buffers``."""
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        self.init_buffers()
        with torch.no_grad():
            load_embeddings_and_head(self, sd)
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                att = p + "self_attn."
                bias = self.arch.attention_bias
                load_projections(layer, sd, p, bias, bias)
                norms = ["input_layernorm", "post_attention_layernorm"]
                if self.arch.sandwich_norms:
                    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
                for norm in norms:
                    getattr(layer, norm).weight.copy_(sd[p + norm + ".weight"])
                if self.arch.qk_norm:
                    layer.q_norm.weight.copy_(sd[att + "q_norm.weight"])
                    layer.k_norm.weight.copy_(sd[att + "k_norm.weight"])


@dataclass(frozen=True)
class ImageFrameLayout:
    """How Gemma 3 frames an image in a prompt: the prompt names it with ``boi_token_id``
    (``<start_of_image>``, what the chat template writes); the processor turns that into
    ``"\n\n" <start_of_image> <image_soft_token> x tokens_per_image <end_of_image> "\n\n"``
    (transformers' ``Gemma3Processor.full_image_sequence``), of which only the
    ``image_token_id`` tokens take the image's embeddings."""

    boi_token_id: int
    image_token_id: int
    eoi_token_id: int
    tokens_per_image: int


def image_frame_layout(hf_config: Any) -> ImageFrameLayout:
    """The image layout of a Gemma 3 config (transformers' ``Gemma3Config`` or the dict of
    its config.json): ``boi_token_index``, ``image_token_index``, ``eoi_token_index`` and
    ``mm_tokens_per_image``."""
    config = config_from_dict(hf_config, {"gemma3": "Gemma3Config"})
    return ImageFrameLayout(
        boi_token_id=config.boi_token_index,
        image_token_id=config.image_token_index,
        eoi_token_id=config.eoi_token_index,
        tokens_per_image=config.mm_tokens_per_image,
    )


@dataclass(frozen=True)
class Gemma3Arch(GemmaArch):
    """The language model's arch (``text_config``), and the vision side's."""

    # None only as a dataclass default (fields after GemmaArch's need one): from_hf sets it.
    vision: SiglipVisionArch | None = None
    mm_tokens_per_image: int = 0  # rows per image: (patches_per_side / pool_kernel) ** 2
    pool_kernel: int = 1  # the projector's average pool, side and stride, in patches

    @classmethod
    def from_hf(cls, config: Any) -> Gemma3Arch:
        """The arch of a ``Gemma3Config``; ``ValueError`` naming the field it cannot serve:
        ``mm_tokens_per_image`` must be a square whose side divides the tower's patches per
        side (the pool's kernel is their ratio)."""
        base = GemmaArch.from_hf(config.get_text_config())
        base = {f.name: getattr(base, f.name) for f in fields(GemmaArch)}
        vision = SiglipVisionArch.from_hf(config.vision_config)
        tokens = config.mm_tokens_per_image
        side = math.isqrt(tokens) if isinstance(tokens, int) and tokens > 0 else 0
        if side * side != tokens:
            raise ValueError(f"mm_tokens_per_image {tokens!r} is not a positive square")
        per_side = vision.patches_per_side
        if per_side % side:
            raise ValueError(
                f"mm_tokens_per_image {tokens}: its side {side} does not divide the tower's "
                f"{per_side} patches a side (vision_config.image_size {vision.image_size} // "
                f"patch_size {vision.patch_size})"
            )
        return cls(**base, vision=vision, mm_tokens_per_image=tokens, pool_kernel=per_side // side)


class Gemma3MultiModalProjector(nn.Module):
    """(n, patches, vision hidden) -> (n, mm_tokens_per_image, hidden): the patch grid
    average-pooled by ``pool_kernel`` squares, Gemma-RMS-normed (``mm_soft_emb_norm``, the
    tower's eps), times ``mm_input_projection_weight`` (vision hidden, hidden)."""

    def __init__(self, a: Gemma3Arch) -> None:
        super().__init__()
        v = a.vision
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(v.hidden_size, a.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(v.hidden_size, v.layer_norm_eps)
        self.per_side = v.patches_per_side
        self.kernel = a.pool_kernel

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        n, _, width = features.shape
        side = self.per_side
        grid = features.transpose(1, 2).reshape(n, width, side, side)  # row-major patches
        pooled = F.avg_pool2d(grid, self.kernel)  # (n, width, side / k, side / k)
        pooled = pooled.flatten(2).transpose(1, 2)  # (n, tokens, width), row-major
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(GemmaForCausalLM):
    """Gemma 3's multimodal checkpoints (4B, 12B, 27B: ``Gemma3ForConditionalGeneration``):
    the language model of ``text_config`` (every ``GemmaForCausalLM`` method, ``forward``
    taking ``inputs_embeds``), with ``vision_tower`` (SigLIP, ``siglip_vision.py``) and
    ``multi_modal_projector`` beside it (module docstring)."""

    # The prompt frames each image (``ImageFrameLayout``; vllm/multimodal/processing.py).
    image_layout: ClassVar[str] = "framed"
    supports_images: ClassVar[bool] = True
    # Each image's tokens attend to each other both ways (transformers' Gemma 3 mask: the
    # ``token_type_ids`` blocks); the model runner marks their spans for the backend.
    bidirectional_image_attention: ClassVar[bool] = True

    @staticmethod
    def arch_from_hf(hf_config: Any) -> Gemma3Arch:
        return Gemma3Arch.from_hf(hf_config)

    @staticmethod
    def takes_images(hf_config: Any) -> bool:
        return takes_images(hf_config)

    def __init__(self, arch: Gemma3Arch) -> None:
        super().__init__(arch)
        self.vision_tower = SiglipVisionModel(arch.vision)
        self.multi_modal_projector = Gemma3MultiModalProjector(arch)

    @property
    def attention_features(self) -> frozenset[str]:
        """The language model's, and spans attending both ways (its images')."""
        return super().attention_features | {"bidirectional_spans"}

    @property
    def max_image_tokens(self) -> int:
        """The tokens one image's embeddings take (a prefill chunk must hold them all)."""
        return self.arch.mm_tokens_per_image

    @torch.inference_mode()
    def embed_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(num_images, 3, image_size, image_size) pixels (any float dtype, any device) ->
        (num_images, mm_tokens_per_image, hidden) embeddings in the model's dtype, on its
        device: the rows of each image's ``image_token_id`` tokens, in order, to be written
        over those of ``embed_input_ids`` (transformers scatters them after the scaling)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        """The language model's tensors (``GemmaForCausalLM.load_weights``), the tower's and
        the projector's, from either layout (module docstring). ``ValueError`` when the
        checkpoint holds no vision tower tensors."""
        super().load_weights(language_model_tensors(sd))
        parts: dict[str, dict[str, torch.Tensor]] = {p: {} for p in VISION_PREFIXES}
        for key, tensor in sd.items():
            key = key.removeprefix("model.")
            for prefix, part in parts.items():
                if key.startswith(prefix):
                    part[key.removeprefix(prefix)] = tensor
        tower, projector = parts.values()
        if not tower:
            raise ValueError(
                "no vision tower tensors in the checkpoint (looked under vision_tower. and "
                "model.vision_tower.): a Gemma 3 multimodal checkpoint needs its tower"
            )
        self.vision_tower.load_weights(tower)
        self.multi_modal_projector.load_state_dict(projector)
