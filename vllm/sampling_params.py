"""Sampling parameters for text generation (vLLM's ``SamplingParams``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from vllm.exceptions import VLLMValidationError


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output when the request finishes


@dataclass
class SamplingParams:
    """How to sample one request's tokens.

    ``extra_args`` carries per-request data that is not about sampling; the agent
    metadata ``job_id`` (str) and ``is_last_step`` (bool) travel there, as in the
    research fork. Invalid values raise ``VLLMValidationError`` (a ``ValueError``) whose
    ``param`` is the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    # Filled by the engine: every stop token id (EOS included unless ignore_eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, value: Any, why: str) -> VLLMValidationError:
            return VLLMValidationError(f"{name} {why}, got {value!r}", name, value)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be -1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be in (0, 2]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", self.logprobs, "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", self.prompt_logprobs, "must be in [0, 20]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, dict):
                raise bad("extra_args", self.extra_args, "must be a dict")
            job_id = self.extra_args.get("job_id")
            if job_id is not None and not isinstance(job_id, str):
                raise bad("job_id", job_id, "must be a string")
            last = self.extra_args.get("is_last_step")
            if last is not None and not isinstance(last, bool):
                raise bad("is_last_step", last, "must be a boolean")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def job_id(self) -> str | None:
        return (self.extra_args or {}).get("job_id")

    @property
    def is_last_step(self) -> bool:
        return bool((self.extra_args or {}).get("is_last_step", False))

    def update_from_generation_config(self, eos_token_id: int | None) -> None:
        """Add the model's EOS to the stop set unless ``ignore_eos``."""
        if eos_token_id is not None and not self.ignore_eos:
            self.all_stop_token_ids.add(eos_token_id)

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
