"""The one map from an attention backend's name to its class.

The selector tries every registered backend (highest ``priority`` first) and
``VLLM_ATTENTION_BACKEND`` must name one of them, so a backend is one module with an
``AttentionBackend`` subclass plus one line here (or a ``register_backend`` call from a
plugin or a test). Classes are imported on first use (``module:Class``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.attention.backends.abstract import AttentionBackend

_REGISTRY: dict[str, str | type[AttentionBackend]] = {
    # torch's own FlashAttention (varlen_attn; CUDA, fp16/bf16): nothing to install.
    "TORCH_FLASH_ATTN": "vllm.v1.attention.backends.torch_flash:TorchFlashAttentionBackend",
    # The flash-attn package's varlen kernel (CUDA, fp16/bf16), for those who have it.
    "FLASH_ATTN": "vllm.v1.attention.backends.flash_attn:FlashAttentionBackend",
    # MLA models (DeepSeek-V2/V3) on CUDA: the Triton latent decode kernel, SDPA prefill.
    "TRITON_MLA": "vllm.v1.attention.backends.triton_mla:TritonMLABackend",
    # torch SDPA + the native CPU kernels: runs anywhere (the fallback).
    "TORCH_SDPA": "vllm.v1.attention.backends.torch_sdpa:TorchSDPABackend",
}


def register_backend(name: str, backend: str | type[AttentionBackend]) -> None:
    """Register ``backend`` (a class, or ``"module:Class"`` imported on first use) as
    ``name`` (upper case, as ``VLLM_ATTENTION_BACKEND`` is read); replaces an entry."""
    if name != name.upper():
        raise ValueError(f"attention backend name {name!r} must be upper case")
    _REGISTRY[name] = backend


def backend_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_backend_class(name: str) -> type[AttentionBackend]:
    """The class registered as ``name``; ValueError listing the registered names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown attention backend {name!r}; registered: {', '.join(backend_names())}"
        )
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module_name, class_name = entry.split(":")
        entry = getattr(importlib.import_module(module_name), class_name)
    if entry.name != name:
        raise ValueError(f"attention backend registered as {name!r} is named {entry.name!r}")
    return entry
