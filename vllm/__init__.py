"""vllm-continuum: a vLLM-v1-style serving engine whose scheduler knows about agents."""

from __future__ import annotations

from typing import Any

from vllm.sampling_params import SamplingParams

__version__ = "0.1.0"
# vLLM's output classes, importable from ``vllm`` as there.
_OUTPUTS = ("RequestOutput", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
            "ClassificationOutput", "ClassificationRequestOutput", "PoolingOutput",
            "PoolingRequestOutput", "ScoringOutput", "ScoringRequestOutput")  # fmt: skip
__all__ = ["LLM", "SamplingParams", "PoolingParams", *_OUTPUTS, "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import vllm` must not import torch (the CLI's --help stays fast).
    if name == "LLM":
        from vllm.entrypoints.llm import LLM

        return LLM
    if name in _OUTPUTS:
        from vllm import outputs

        return getattr(outputs, name)
    if name == "PoolingParams":
        from vllm.pooling_params import PoolingParams

        return PoolingParams
    raise AttributeError(f"module 'vllm' has no attribute {name!r}")
