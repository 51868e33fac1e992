"""What the models with recurrent layers share (Qwen3-Next / Qwen3.5 in ``qwen3_next.py``,
the Mamba2 hybrids in ``mamba_hybrid.py`` and ``falcon_h1.py``, LFM2 in ``lfm2.py``): the
embeddings, the layers (``make_layer``), the final norm (``norm_class``) and the output
head, the rotary table of their attention layers, each layer's place among the layers
with a KV cache and among those with recurrent states, and a checkpoint whose missing
tensor is named. Each family writes its own ``forward`` (its layers' residual structure),
``recurrent_state_specs`` and ``load_weights``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from vllm.model_executor.models.llama import RMSNorm, RotaryEmbedding


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
