"""vLLM's ``PoolingParams``, as far as this engine's pooling runner goes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

POOLING_TASKS = ("embed", "classify")


@dataclass
class PoolingParams:
    """How one prompt is pooled. ``use_activation``: the activation over the pooled
    values (embed: L2 normalisation; classify: softmax over the labels), None: the
    pooler config's (on unless it says not). ``task``: the task asked for (None: the
    caller's, ``LLM.embed``'s embed or ``LLM.classify``'s classify); it must be the
    model's. ``dimensions`` (matryoshka truncation) is refused: the embeddings are the
    model's whole hidden state."""

    use_activation: bool | None = None
    task: str | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise VLLMValidationError(
                f"use_activation must be a bool or None, got {self.use_activation!r}",
                "use_activation",
            )
        if self.task is not None and self.task not in POOLING_TASKS:
            raise VLLMValidationError(
                f"task must be one of {POOLING_TASKS} or None, got {self.task!r}", "task"
            )
        if self.dimensions is not None:
            raise VLLMValidationError(
                "dimensions is not supported: the embeddings are the model's whole hidden "
                "state (no matryoshka truncation)",
                "dimensions",
            )

    def to_sampling_params(self) -> SamplingParams:
        """The engine request's parameters: one prompt pass, ``use_activation`` riding
        in ``extra_args`` (the runner's pooler reads it there)."""
        extra: dict[str, Any] | None = None
        if self.use_activation is not None:
            extra = {"use_activation": self.use_activation}
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, extra_args=extra)
