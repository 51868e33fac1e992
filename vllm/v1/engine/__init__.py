"""Messages between the front end (LLM / AsyncLLM) and the engine core."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm.sampling_params import SamplingParams
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import TokenLogprobs


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # aborted by the client or the front end

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0  # wall clock at the front end (for latency metrics)
    priority: int = 0
    cache_salt: str | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Set on a request's first output: seconds from engine arrival to first scheduling.
    queue_time_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
