"""The one map from a KV offloading backend's name to its worker-side class.

``--kv-offloading-backend``'s choices and ``OffloadConfig``'s validation read it, so a
name without an implementation cannot be offered. Classes are imported on first use
(``module:Class``); this module imports nothing from the engine, so ``vllm.config`` can
use it.
"""

from __future__ import annotations

import importlib
from typing import Any

_REGISTRY: dict[str, str] = {
    # A second pool of KV blocks in host memory, copied by the runner (vLLM's "native").
    "native": "vllm.v1.kv_offload.worker:CPUOffloadingHandler",
}


def offloading_backend_names() -> tuple[str, ...]:
    """The registered names (``native`` first: the default)."""
    return tuple(_REGISTRY)


def get_offloading_backend_class(name: str) -> Any:
    """The worker-side class registered as ``name``; ValueError naming the flag otherwise."""
    if name not in _REGISTRY:
        raise ValueError(
            f"--kv-offloading-backend must be one of {offloading_backend_names()}, got {name!r}"
        )
    module_name, class_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)
