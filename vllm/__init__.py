"""vllm-continuum: a vLLM-v1-style serving engine whose scheduler knows about agents."""

from __future__ import annotations

from typing import Any

from vllm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import vllm` must not import torch (the CLI's --help stays fast).
    if name == "LLM":
        from vllm.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from vllm import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")
