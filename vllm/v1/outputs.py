"""What the model runner returns each step (vLLM v1's ``ModelRunnerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probability of one sampled token and the top-n alternatives at its position."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the distribution
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens ``start, start + 1, ...`` (positions in the prompt; the
    first token, position 0, has none), one entry per position, each the logprob of the
    prompt's own token with its rank and the top-n: what one prefill chunk computed."""

    start: int
    entries: list[TokenLogprobs]


@dataclass
class RequestFailure:
    """Why one request failed inside a step (the batch's other requests went on).

    ``internal``: a fault of the engine or the model (the server answers 500); otherwise
    the request's own values caused it, e.g. sampling parameters that turn its
    probabilities into NaN (400).
    """

    message: str
    internal: bool = True


@dataclass
class ModelRunnerOutput:
    # Order of requests in this step's batch.
    req_ids: list[str]
    # req_id -> tokens sampled this step: [] for a request still in a partial prefill.
    sampled_token_ids: dict[str, list[int]]
    # req_id -> one entry per sampled token, only for requests that asked for logprobs.
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> prompt logprobs of this step's chunk, for requests that asked for them.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # req_id -> why it failed this step (no token for it); the scheduler finishes it with
    # an error. The runner keeps its state until the id comes back in finished_req_ids.
    errors: dict[str, RequestFailure] = field(default_factory=dict)
    # --runner pooling: req_id -> its prompt's embedding, once its prompt is computed (the
    # scheduler then finishes it; it samples nothing).
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # Speculative decoding with a draft model: req_id -> the draft tokens it proposed
    # after this step's tokens (the scheduler's drafts for the request's next step).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids={})
