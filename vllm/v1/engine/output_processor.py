"""Front-end side of engine outputs: detokenize, stop strings, n>1 fan-in, timings."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, WeightVersionSpan
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.outputs import TokenLogprobs

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    """One of the n samples of a user request (one engine-core request)."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    pooled: list[float] | None = None  # --runner pooling: the prompt's embedding
    prefilling: bool = True  # no engine output yet (vLLM's ``is_prefilling``)
    _sent_tokens: int = 0  # tokens already handed out (DELTA: where the next output starts)
    # (weight version, index of the first output token it sampled), in order
    _version_starts: list[tuple[str, int]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput, weight_version: str | None = None) -> bool:
        """Apply one engine output (its tokens sampled by ``weight_version``'s weights);
        True if a stop string ended the sequence here."""
        if out.pooled is not None:
            self.pooled = out.pooled
        starts = self._version_starts
        if (
            out.new_token_ids
            and weight_version is not None
            and (not starts or starts[-1][0] != weight_version)
        ):
            starts.append((weight_version, len(self.token_ids)))
        self.token_ids.extend(out.new_token_ids)
        for lp in out.new_logprobs or ():
            self.logprobs.append(lp)
            self.cumulative_logprob += lp.logprob
        stop_terminated = out.finish_reason == FinishReason.STOP
        stop_string = self.detok.update(out.new_token_ids, stop_terminated)
        if stop_string is None and out.finished:
            stop_string = self.detok.flush()
        if stop_string is not None:
            unused = self.detok.num_unused_tokens  # after the stop string, in one output
            if unused:
                del self.token_ids[len(self.token_ids) - unused :]
                del self.logprobs[len(self.token_ids) :]
            self.finish_reason, self.stop_reason = "stop", stop_string
            return True
        if out.finished:
            self.finish_reason, self.stop_reason = str(out.finish_reason), out.stop_reason
        return False

    def due(self, interval: int) -> bool:
        """Whether this sequence's output goes out now under a stream interval: its first
        tokens, its last output, or ``interval`` tokens since the last one sent."""
        if self.finished or (self._sent_tokens == 0 and self.token_ids):
            return True
        return len(self.token_ids) - self._sent_tokens >= interval

    def completion(self, delta: bool) -> CompletionOutput:
        text = self.detok.get_next_output_text(self.finished, delta)
        start = self._sent_tokens if delta else 0
        self._sent_tokens = len(self.token_ids)
        want_logprobs = self.params.logprobs is not None
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[start:],
            cumulative_logprob=self.cumulative_logprob if want_logprobs else None,
            logprobs=self.logprobs[start:] if want_logprobs else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            weight_versions=self._weight_versions() if self.finished else None,
        )

    def _weight_versions(self) -> list[WeightVersionSpan] | None:
        """The finished sequence's spans; None if its tokens came with no version."""
        n = len(self.token_ids)
        starts = [(v, s) for v, s in self._version_starts if s < n]  # a stop string cut
        if not starts:
            return None if n else []
        ends = [s for _, s in starts[1:]] + [n]
        return [WeightVersionSpan(v, s, e) for (v, s), e in zip(starts, ends, strict=True)]


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    sequences: dict[str, _Sequence]  # engine-core request id -> sequence, in index order
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # a disaggregated prefill's answer
    trace_headers: dict[str, str] | None = None  # the trace its span joins
    # [None] + the prompt's logprobs when asked for (from the first sequence only).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    _sent_prompt_logprobs: bool = False  # DELTA: handed out once
    stream_interval: int = 1  # tokens gathered into each output (first and last at once)
    # With a stream interval: the sequences updated since the last output, by index.
    _held: dict[int, _Sequence] = field(default_factory=dict)

    # Sequences not finished yet (``OutputProcessor.process_outputs`` counts them down).
    num_unfinished: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.num_unfinished = len(self.sequences)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    """Maps engine-core outputs back to user requests (one ``RequestOutput`` each).

    A user request with n > 1 is n engine-core requests (see ``Processor.process``);
    their outputs are gathered into one ``RequestOutput`` with n ``CompletionOutput``s.
    Times in ``RequestOutput.metrics`` are wall-clock (``time.time()``) seconds.
    """

    def __init__(self, tokenizer, stream_interval: int = 1, tracer: Any = None) -> None:
        """``stream_interval``: the engine's --stream-interval (a request may raise it).
        ``tracer``: a ``vllm.tracing.RequestTracer`` (--otlp-traces-endpoint), which gets
        each finished request."""
        self.tracer = tracer
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._states: dict[str, _RequestState] = {}
        self._seq_to_request: dict[str, str] = {}
        # The last ``process_outputs`` call's: for each request that got tokens and had
        # some before, the seconds since its previous ones (vLLM's inter-token latency).
        self.inter_token_latencies: list[float] = []
        # The queue limits' counts (``admission_control.py``): sequences not finished, and
        # the prompt tokens of those with no output yet.
        self._num_queued_seqs = 0
        self._num_queued_tokens = 0

    def get_num_queued_requests(self) -> int:
        """Engine-core requests (samples) not finished: waiting or running."""
        return self._num_queued_seqs

    def get_num_queued_tokens(self) -> int:
        """Prompt tokens of the samples that have had no engine output yet (the whole
        prompt: chunked progress and prefix-cache hits are not known here)."""
        return self._num_queued_tokens

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        core_requests: list[EngineCoreRequest] | EngineCoreRequest,
        arrival_wall_time: float | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> None:
        """Track ``request_id``, made of ``core_requests`` (one per sample when n > 1).
        ``trace_headers``: the W3C trace context its span joins (with a tracer)."""
        if isinstance(core_requests, EngineCoreRequest):
            core_requests = [core_requests]
        if not core_requests:
            raise ValueError("core_requests must not be empty")
        if request_id in self._states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        first = core_requests[0]
        sequences = {
            r.request_id: _Sequence(
                i, r.sampling_params, IncrementalDetokenizer(self.tokenizer, r.sampling_params)
            )
            for i, r in enumerate(core_requests)
        }
        if arrival_wall_time is None:
            arrival_wall_time = first.arrival_wall_time or time.time()
        self._states[request_id] = _RequestState(
            request_id,
            prompt,
            first.prompt_token_ids,
            first.sampling_params.output_kind,
            sequences,
            RequestMetrics(
                arrival_wall_time,
                n=len(core_requests),
                max_tokens=first.sampling_params.max_tokens,
            ),
            prompt_logprobs=None if first.sampling_params.prompt_logprobs is None else [None],
            stream_interval=max(first.sampling_params.stream_interval or 1, self.stream_interval),
            trace_headers=trace_headers,
        )
        for r in core_requests:
            self._seq_to_request[r.request_id] = request_id
        self._num_queued_seqs += len(core_requests)
        self._num_queued_tokens += len(first.prompt_token_ids) * len(core_requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def get_num_unfinished_requests(self) -> int:
        return len(self._states)

    def child_ids(self, request_id: str) -> list[str]:
        """Engine-core request ids of ``request_id`` ([] if unknown or finished)."""
        state = self._states.get(request_id)
        return list(state.sequences) if state else []

    def abort_request(self, request_id: str) -> list[str]:
        """Forget ``request_id``; returns its engine-core ids (to abort in the core)."""
        state = self._states.pop(request_id, None)
        if state is None:
            return []
        for seq_id, seq in state.sequences.items():
            self._seq_to_request.pop(seq_id, None)
            if not seq.finished:
                self._num_queued_seqs -= 1
                self._end_prefill(state, seq)
        return list(state.sequences)

    def _end_prefill(self, state: _RequestState, seq: _Sequence) -> None:
        if seq.prefilling:
            seq.prefilling = False
            self._num_queued_tokens -= len(state.prompt_token_ids)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], weight_version: str | None = None
    ) -> tuple[list[RequestOutput], list[str]]:
        """User-visible outputs, and engine-core ids that ended on a stop string (the
        engine must finish them as stopped: ``EngineCore.stop_requests``).
        ``weight_version``: the weights that sampled these outputs' tokens."""
        now = time.time()
        self.inter_token_latencies = []
        updated: dict[str, list[_Sequence]] = {}
        reqs_to_stop: list[str] = []
        for out in outputs:
            request_id = self._seq_to_request.get(out.request_id)
            state = self._states.get(request_id) if request_id is not None else None
            if state is None:
                continue  # aborted by the front end meanwhile
            seq = state.sequences[out.request_id]
            if seq.finished:
                continue
            self._end_prefill(state, seq)
            self._update_metrics(state, out, now)
            if out.new_prompt_logprobs and state.prompt_logprobs is not None and seq.index == 0:
                state.prompt_logprobs.extend(out.new_prompt_logprobs)
            if seq.update(out, weight_version) and not out.finished:
                reqs_to_stop.append(out.request_id)  # the engine core must stop it too
            if seq.finished:
                state.num_unfinished -= 1
                self._num_queued_seqs -= 1
            m = state.metrics
            m.max_num_generation_tokens = max(m.max_num_generation_tokens, len(seq.token_ids))
            updated.setdefault(request_id, []).append(seq)
        results = []
        for request_id, seqs in updated.items():
            result = self._make_output(self._states[request_id], seqs, now)
            if result is not None:
                results.append(result)
        return results, reqs_to_stop

    def _update_metrics(self, state: _RequestState, out: EngineCoreOutput, now: float) -> None:
        m = state.metrics
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            elif m.last_token_time is not None and m.last_token_time != now:
                # Once per request and call: its other sequences' tokens came with these.
                self.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
            m.num_generation_tokens += len(out.new_token_ids)
        if out.queue_time_s is not None and m.queue_time is None:
            m.queue_time = out.queue_time_s
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            state.kv_transfer_params = out.kv_transfer_params

    def _trace(self, state: _RequestState) -> None:
        seqs = list(state.sequences.values())
        try:
            self.tracer.emit(
                state.request_id,
                state.metrics,
                seqs[0].params,
                len(state.prompt_token_ids),
                state.num_cached_tokens,
                [s.finish_reason or "" for s in seqs],
                state.trace_headers,
            )
        except Exception:  # noqa: BLE001 - a trace never fails a request
            logger.warning("tracing request %s failed", state.request_id, exc_info=True)

    def _make_output(
        self, state: _RequestState, updated: list[_Sequence], now: float
    ) -> RequestOutput | None:
        finished = state.finished
        if finished:
            state.metrics.finished_time = now
            self.abort_request(state.request_id)
            if self.tracer is not None:
                self._trace(state)
        kind = state.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if state.stream_interval > 1:
            # Held back until a sequence is due; DELTA then reports every sequence that
            # moved since the last output (``updated`` is this call's only).
            due = finished
            for seq in updated:
                state._held[seq.index] = seq
                due = due or seq.due(state.stream_interval)
            if not due:
                return None
            updated, state._held = list(state._held.values()), {}
        delta = kind == RequestOutputKind.DELTA
        # DELTA reports only the sequences that moved, so a finished one is reported once.
        seqs = sorted(updated, key=lambda s: s.index) if delta else state.sequences.values()
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            # As vLLM: all of them at once, once complete (with the first token), then none.
            complete = len(prompt_logprobs) == len(state.prompt_token_ids)
            if state._sent_prompt_logprobs or not complete:
                prompt_logprobs = None
            else:
                state._sent_prompt_logprobs = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[s.completion(delta) for s in seqs],
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
            prompt_logprobs=prompt_logprobs,
            pooled=next(iter(state.sequences.values())).pooled,
            kv_transfer_params=state.kv_transfer_params if finished else None,
        )
