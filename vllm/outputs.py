"""What the front end returns to users (vLLM's ``RequestOutput``, ``CompletionOutput``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm.v1.outputs import TokenLogprobs


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were sampled by the weights labelled ``version``
    (vLLM's; the version an RL weight sync names, "default" before any)."""

    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    """One generated sequence (one of the request's n samples).

    In DELTA mode ``text``, ``token_ids`` and ``logprobs`` hold only what is new since
    the previous output of this request; otherwise everything so far.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None  # None unless SamplingParams.logprobs
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop string or stop token id (None for EOS)
    # Once finished: which weights sampled which of its tokens (spans in order).
    weight_versions: list[WeightVersionSpan] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()``) of one request, for latency metrics.

    TTFT = first_token_time - arrival_time; e2e = finished_time - arrival_time;
    TPOT = (last_token_time - first_token_time) / (num_generation_tokens - 1).
    """

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    queue_time: float | None = None  # seconds waiting in the engine before scheduling
    num_generation_tokens: int = 0  # over all n sequences
    max_num_generation_tokens: int = 0  # the longest sequence's
    n: int = 1  # the request's sampling parameters (for vLLM's request_params_* metrics)
    max_tokens: int | None = None

    @property
    def scheduled_time(self) -> float | None:
        """When the engine first scheduled it (arrival plus the engine's queue time)."""
        return None if self.queue_time is None else self.arrival_time + self.queue_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one user request: its prompt and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (no
    # context predicts it); each the logprob of the prompt's token, its rank and the top-n.
    # Complete once the first output token exists (all at once, also in DELTA mode).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # --runner pooling: the prompt's embedding (vLLM's PoolingRequestOutput data), once
    # finished; such a request generates no token.
    pooled: list[float] | None = None
    # A disaggregated prefill's answer (--kv-transfer-config), once finished: where its KV
    # is held, for the consumer that decodes (vLLM's RequestOutput.kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None


def merge_delta(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """DELTA outputs ``first`` and ``then`` of one request as one new output that says
    what both said (vLLM's output collector does the same when a stream's reader falls
    behind): each sequence's text, tokens and logprobs appended, the rest (finish reason,
    metrics, cached tokens) ``then``'s; the prompt's logprobs, sent once, wherever they
    came. Neither argument is changed (the stats loggers still read them)."""
    merged = {c.index: c for c in first.outputs}
    for c in then.outputs:
        old = merged.get(c.index)
        if old is not None:
            c = dataclasses.replace(
                c,
                text=old.text + c.text,
                token_ids=old.token_ids + c.token_ids,
                logprobs=None if c.logprobs is None else (old.logprobs or []) + c.logprobs,
            )
        merged[c.index] = c
    return dataclasses.replace(
        then,
        outputs=[merged[i] for i in sorted(merged)],
        prompt_logprobs=first.prompt_logprobs
        if then.prompt_logprobs is None
        else then.prompt_logprobs,
    )


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """``LLM.embed``'s result for one prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's ``ClassificationOutput``): the score
    head's logits after the classifier's activation (softmax over the labels), or the
    logits themselves with ``use_activation=False``."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify``'s result for one prompt (vLLM's ``ClassificationRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass
class PoolingOutput:
    """One prompt's pooled values (vLLM's ``PoolingOutput``): an embedding model's
    embedding, a classifier's probabilities (``LLM.encode``)."""

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """``LLM.encode``'s result for one prompt (vLLM's ``PoolingRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``): an embedding model's cosine
    similarity of the pair's embeddings, or a one-label classifier's (a cross-encoder's)
    output for the pair as one prompt."""

    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result for one pair (vLLM's ``ScoringRequestOutput``):
    ``prompt_token_ids`` are the pair's two prompts' tokens, one after the other."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class BeamSearchSequence:
    """One beam of ``LLM.beam_search``, as vLLM's: ``tokens`` the prompt's and then the
    generated ones, ``text`` all of them decoded, ``cum_logprob`` the generated tokens'."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]
