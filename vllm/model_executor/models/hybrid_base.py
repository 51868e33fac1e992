"""What the models with recurrent layers share (Qwen3-Next / Qwen3.5 in ``qwen3_next.py``,
the Mamba2 hybrids in ``mamba_hybrid.py`` and ``falcon_h1.py``, LFM2 in ``lfm2.py``): the
embeddings, the layers (``make_layer``), the final norm (``norm_class``) and the output
head, the rotary table of their attention layers, the forward over a step (its recurrent
plan worked out once, ``StepMixers``), each layer's place among the layers with a KV cache
and among those with recurrent states, and a checkpoint whose missing tensor is named.
Each family writes its layers' residual structure (``layer_forward``),
``recurrent_state_specs`` and ``load_weights``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.layers.recurrent import RecurrentBatch, RecurrentStep
from vllm.model_executor.models.llama import RMSNorm, RotaryEmbedding
from vllm.v1.attention.backends.abstract import layer_metadata


class CheckpointTensors(dict):
    """A checkpoint's tensors by name; a missing one is a ``ValueError`` naming it."""

    def __missing__(self, key: str) -> torch.Tensor:
        raise ValueError(f"checkpoint tensor {key!r} is missing: the checkpoint does not "
                         "match its config")  # fmt: skip


def layer_places(kinds: tuple[str, ...], counts: Callable[[str], bool]) -> list[int]:
    """Each layer's place among the layers of ``kinds`` that ``counts`` (its KV cache's
    index among the attention layers, its states' among the recurrent ones)."""
    places, n = [], 0
    for kind in kinds:
        places.append(n)
        n += counts(kind)
    return places


@dataclass(frozen=True)
class StepMixers:
    """One forward's inputs to the layers' mixers: a recurrent mixer's states (the ``j``-th
    layer with states) and an attention's KV cache (the ``j``-th with one)."""

    positions: torch.Tensor
    rope: RotaryEmbedding | None
    metas: Any  # per attention layer
    kv_caches: Any
    states: list[tuple[torch.Tensor, ...]]  # per recurrent layer: its pools
    step: RecurrentStep

    def recurrent(self, mixer: nn.Module, j: int, h: torch.Tensor) -> torch.Tensor:
        return mixer(h, self.states[j], self.step)

    def attention(self, mixer: nn.Module, j: int, h: torch.Tensor) -> torch.Tensor:
        return mixer(self.positions, h, self.rope, self.metas[j], self.kv_caches[j])


class HybridCausalLM(nn.Module):
    """The shared frame (module docstring); ``arch`` has ``vocab_size``, ``hidden_size``,
    ``rms_norm_eps``, ``layer_types``, ``tie_word_embeddings`` and, for a rotary table,
    ``rope`` (None: unrotated), ``head_dim``, ``max_position_embeddings``."""

    gguf_layout: ClassVar[Any] = None  # --quantization gguf: refused with its reason
    norm_class: ClassVar[type[nn.Module]] = RMSNorm  # the final norm's

    def __init__(self, arch: Any) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(len(arch.layer_types)))
        self.norm = self.norm_class(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.rope = self._rope()

    def make_layer(self, i: int) -> nn.Module:
        raise NotImplementedError

    def _rope(self) -> RotaryEmbedding | None:
        a = self.arch
        return None if a.rope is None else (
            RotaryEmbedding(a.head_dim, a.max_position_embeddings, a.rope)
        )  # fmt: skip

    @property
    def attention_features(self) -> frozenset[str]:
        return frozenset()

    @torch.inference_mode()
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

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
        """(num_tokens,) ids -> (num_tokens, hidden) final hidden states. ``kv_caches`` and
        ``meta`` are the attention layers'; ``recurrent`` the step's sequences and the
        recurrent layers' pools (None: every row one fresh sequence, on scratch states)."""
        if positions.dim() != 1:
            raise ValueError(f"positions of shape {tuple(positions.shape)}: (num_tokens,)")
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        # once: every layer serves the step alike
        recurrent, step = RecurrentStep.of_forward(recurrent, self, x)
        metas = layer_metadata(meta, self.arch.num_layers)
        mixers = StepMixers(positions, self.rope, metas, kv_caches, recurrent.states, step)
        for i in range(len(self.layers)):
            x = self.layer_forward(i, x, mixers)
        return self.norm(x)

    def layer_forward(self, i: int, x: torch.Tensor, mixers: StepMixers) -> torch.Tensor:
        """The residual stream after layer ``i``."""
        raise NotImplementedError

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def init_buffers(self) -> None:
        """The rotary table (fp32 on the CPU, then in the weights' dtype and device), if
        any, and the tied output head."""
        weight = self.embed_tokens.weight
        rope = self._rope()
        self.rope = None if rope is None else rope.to(weight.dtype).to(weight.device)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
