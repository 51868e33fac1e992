"""Sampling parameters for text generation (vLLM's ``SamplingParams``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm_continuum.cache_hints import TTL_KEY, may_offload, validate_cache_hints
from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL, validate_job_id

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Upstream vLLM only requires repetition_penalty > 0. Our sampler divides positive logits
# by it, so a tiny one (1e-300) turns them into inf and the probabilities into NaN; 0.01
# keeps float32 logits (|x| < ~1e3) far from overflow and is already an extreme setting.
MIN_REPETITION_PENALTY = 0.01


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:  # numpy scalars too
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bad(name: str, value: Any, why: str) -> VLLMValidationError:
    return VLLMValidationError(f"{name} {why}, got {value!r}", name, value)


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's name): exactly one of ``json`` (a JSON schema,
    dict or string), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings), ``grammar`` (Lark syntax, llguidance's dialect) or ``structural_tag``
    (vLLM's: free text in which each ``{"begin", "schema", "end"}`` structure, once the
    output reaches one of its ``triggers``, must follow its JSON schema up to its end
    tag; a dict or its JSON text). The grammar is checked
    at the front end (``vllm.v1.structured_output.validate``) and enforced by a token mask
    before every sampling step.

    ``after_reasoning``: a reasoning model's end tag (``"</think>"``, set by
    ``--reasoning-parser``): the output is free text up to its first occurrence, then
    the constraint holds (after optional whitespace), as vLLM starts the grammar once the
    reasoning is over."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    after_reasoning: str | None = None

    def __post_init__(self) -> None:
        kinds = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
        given = [k for k in kinds if getattr(self, k)]
        if len(given) != 1:
            raise VLLMValidationError(
                f"structured_outputs needs exactly one constraint, got {given or 'none'}",
                "structured_outputs",
            )


# The longest n-gram repetition_detection looks for, and the longest tail it may compare
# (max_pattern_size * min_count): its check runs after every token of the request.
MAX_REPETITION_PATTERN = 1024
MAX_REPETITION_SPAN = 16384


@dataclass
class RepetitionDetectionParams:
    """vLLM's: end a request (finish_reason ``"repetition"``, stop_reason
    ``"repetition_detected"``) once its output ends in an n-gram of ``min_pattern_size``
    to ``max_pattern_size`` tokens (a min of 0 means 1) repeated ``min_count`` times in a
    row, such as a model looping on one line. ``max_pattern_size`` 0: off. Checked after
    every token once ``min_tokens`` are out."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        name = "repetition_detection"
        sizes = (self.max_pattern_size, self.min_pattern_size, self.min_count)
        if not all(_is_int(v) and v >= 0 for v in sizes):
            raise _bad(name, self, "sizes and min_count must be integers >= 0")
        if self.min_pattern_size > self.max_pattern_size:
            raise _bad(name, self, "min_pattern_size must be <= max_pattern_size")
        if self.max_pattern_size > MAX_REPETITION_PATTERN:
            raise _bad(name, self, f"max_pattern_size must be <= {MAX_REPETITION_PATTERN}")
        if self.max_pattern_size * self.min_count > MAX_REPETITION_SPAN:
            raise _bad(name, self, f"max_pattern_size * min_count must be <= {MAX_REPETITION_SPAN}")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise _bad(name, self, "min_count must be >= 2 (or max_pattern_size 0: off)")

    def repeats(self, token_ids: list[int]) -> bool:
        """Whether ``token_ids`` ends in a pattern repeated ``min_count`` times. Token by
        token from the end, stopping at the first difference: a tail that does not
        repeat costs a comparison or two per size."""
        ids, n, count = token_ids, len(token_ids), self.min_count
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if size * count > n:
                return False
            if all(
                ids[n - 1 - j] == ids[n - 1 - j - size * k]
                for k in range(1, count)
                for j in range(size)
            ):
                return True
        return False


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
    # False: the outputs carry token ids and no text (vLLM's; saves the front end's
    # detokenization, e.g. in throughput benchmarks). Stop strings need the text.
    detokenize: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: new tokens gathered into each streamed output (the first and the last are
    # sent at once); raises the engine's --stream-interval for this request, never lowers
    # it. None: the engine's.
    stream_interval: int | None = None
    extra_args: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the token's logit before sampling (OpenAI's logit_bias, values in [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's extra).
    allowed_token_ids: list[int] | None = None
    # Words the output may not contain (vLLM's extra): their token sequences, with and
    # without a leading space, are filled in by the front end (``bad_words_token_ids``).
    bad_words: list[str] | None = None
    # Keep only k of the prompt's tokens (-1: max_model_len), its last ones unless
    # truncation_side is "right" (vLLM's); None: never truncate.
    truncate_prompt_tokens: int | None = None
    truncation_side: str = "left"
    # vLLM's: slow tokenizers put a space between special tokens they decode; fast ones
    # (those with a Rust backend) put none either way.
    spaces_between_special_tokens: bool = True
    # vLLM's: stop on a repeated n-gram (RepetitionDetectionParams; a dict is taken too).
    repetition_detection: RepetitionDetectionParams | None = None
    # Filled by the engine: every stop token id (EOS included unless ignore_eos).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled by the front end from ``bad_words`` (the tokenizer's ids of each variant).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # vLLM's: at most this many output tokens of reasoning; then the reasoning's end is
    # forced. None (or -1, vLLM's "unlimited"): no budget. Needs the reasoning's end
    # sequences, which the server fills from --reasoning-parser (``thinking_end_token_ids``:
    # the first is forced; any of them ends the reasoning).
    thinking_token_budget: int | None = None
    thinking_end_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # The sampler's record of how far the output was searched for those (engine-side).
    thinking_scan: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.thinking_token_budget == -1 and _is_int(self.thinking_token_budget):
            self.thinking_token_budget = None
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        # Every value is checked here, at the front end (server and LLM alike), so none can
        # reach the sampler as NaN, inf or an out-of-range integer and crash the engine.
        # Chained comparisons are False for NaN, so ``not lo <= x <= hi`` rejects it.
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", self.n, "must be an integer >= 1")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature < math.inf:
            raise _bad("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT64_MAX:
            raise _bad("top_k", self.top_k, "must be -1, 0 (disabled) or a positive int64")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise _bad(name, value, "must be in [-2, 2]")
        rep = self.repetition_penalty
        if not _is_number(rep) or not MIN_REPETITION_PENALTY <= rep <= 2.0:
            raise _bad("repetition_penalty", rep, f"must be in [{MIN_REPETITION_PENALTY}, 2]")
        if self.seed is not None and (
            not _is_int(self.seed) or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise _bad("seed", self.seed, "must be an integer in the int64 range")
        self._verify_lengths_and_stops()
        self._verify_extra_args()

    def _verify_lengths_and_stops(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            # The bound is the engine's (--max-logprobs, checked by the Processor).
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise _bad(name, value, "must be an integer >= 0, or -1 for the whole vocabulary")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _bad("stop", self.stop, "must be non-empty strings")
        if self.stop and not self.detokenize:
            raise _bad("stop", self.stop, "stop strings need detokenize=True")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        self._verify_token_lists()

    def _verify_token_lists(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or any(not _is_int(t) or t < 0 for t in bias):
                raise _bad("logit_bias", bias, "must map non-negative token ids to biases")
            if any(not _is_number(v) or not -100.0 <= v <= 100.0 for v in bias.values()):
                raise _bad("logit_bias", bias, "biases must be numbers in [-100, 100]")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list)
            or any(not isinstance(w, str) or not w.strip() for w in words)
        ):
            raise _bad("bad_words", words, "must be a list of non-blank strings")
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise _bad(
                "thinking_token_budget", budget, "must be an integer >= 0, or -1 for no budget"
            )
        interval = self.stream_interval
        if interval is not None and (not _is_int(interval) or interval < 1):
            raise _bad("stream_interval", interval, "must be an integer >= 1")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or (k < 1 and k != -1)):
            raise _bad("truncate_prompt_tokens", k, "must be an integer >= 1, or -1")
        if self.truncation_side not in ("left", "right"):
            raise _bad("truncation_side", self.truncation_side, "must be 'left' or 'right'")
        detection = self.repetition_detection
        if isinstance(detection, dict):
            try:
                detection = RepetitionDetectionParams(**detection)
            except TypeError as e:
                raise _bad("repetition_detection", detection, f"is malformed ({e})") from None
            self.repetition_detection = detection
        if detection is not None and not isinstance(detection, RepetitionDetectionParams):
            raise _bad("repetition_detection", detection, "must be RepetitionDetectionParams")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list)
            or not allowed
            or any(not _is_int(t) or t < 0 for t in allowed)
        ):
            raise _bad(
                "allowed_token_ids", allowed, "must be a non-empty list of non-negative token ids"
            )

    def _verify_extra_args(self) -> None:
        if self.extra_args is None:
            return
        if not isinstance(self.extra_args, dict):
            raise _bad("extra_args", self.extra_args, "must be a dict")
        # The engine reads these two (Request); the server's protocol models type them
        # already, this guards the offline API.
        job_id = self.extra_args.get("job_id")
        try:
            validate_job_id(job_id)
        except ValueError as e:
            raise VLLMValidationError(str(e), "job_id", job_id) from None
        for name in ("is_last_step", LAST_UNLESS_TOOL_CALL):
            value = self.extra_args.get(name)
            if value is not None and not isinstance(value, bool):
                raise _bad(name, value, "must be a boolean")
        transfer = self.extra_args.get("kv_transfer_params")
        if transfer is not None and not isinstance(transfer, dict):
            raise _bad("kv_transfer_params", transfer, "must be a dict")
        if transfer and self.n != 1:  # one prefill's blocks are held for one fetch
            raise _bad("kv_transfer_params", transfer, "needs n 1")
        try:
            validate_cache_hints(self.extra_args)
        except ValueError as e:
            raise VLLMValidationError(str(e), "extra_args") from None

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def job_id(self) -> str | None:
        return (self.extra_args or {}).get("job_id")

    @property
    def is_last_step(self) -> bool:
        return bool((self.extra_args or {}).get("is_last_step", False))

    @property
    def last_step_unless_tool_call(self) -> bool:
        """The job ends with this turn unless its output calls a tool (set by APIs whose
        turn without a tool call answers the user: ``/v1/responses``)."""
        return bool((self.extra_args or {}).get(LAST_UNLESS_TOOL_CALL, False))

    @property
    def cache_ttl_s(self) -> float | None:
        """The client's floor on this turn's pin (``vllm_continuum.cache_hints``)."""
        return (self.extra_args or {}).get(TTL_KEY)

    @property
    def may_offload(self) -> bool:
        """Whether this request's context may go to the host-memory KV tier."""
        return may_offload(self.extra_args)

    def update_from_generation_config(
        self, eos_token_id: int | None, extra_eos_token_ids: Collection[int] = ()
    ) -> None:
        """Add the model's EOS and the generation config's other EOS ids to the stop set,
        unless ``ignore_eos`` (a stop on one of the others reports its id as
        ``stop_reason``, as vLLM's, where they join ``stop_token_ids``)."""
        if self.ignore_eos:
            return
        if eos_token_id is not None:
            self.all_stop_token_ids.add(eos_token_id)
        self.all_stop_token_ids.update(extra_eos_token_ids)

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """``LLM.beam_search``'s parameters, vLLM's: ``beam_width`` beams of up to
    ``max_tokens`` tokens, scored by cumulative logprob / length ** ``length_penalty``.
    Beam search is deterministic: ``temperature`` must stay 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise _bad("beam_width", self.beam_width, "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.temperature != 0:
            raise _bad("temperature", self.temperature, "must be 0: beam search does not sample")
        if not _is_number(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise _bad("length_penalty", self.length_penalty, "must be a finite number")
