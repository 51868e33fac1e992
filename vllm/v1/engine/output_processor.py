"""Front-end side of engine outputs: detokenize, stop strings, n>1 fan-in, timings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer


@dataclass
class _Child:
    """One sequence (one of the n samples of a request)."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_text: int = 0  # DELTA mode: characters already delivered
    sent_tokens: int = 0

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        delta = kind == RequestOutputKind.DELTA
        text = self.detok.output_text[self.sent_text :] if delta else self.detok.output_text
        tokens = self.token_ids[self.sent_tokens :] if delta else list(self.token_ids)
        logprobs = self.logprobs[self.sent_tokens :] if delta else list(self.logprobs)
        if delta:
            self.sent_text, self.sent_tokens = len(self.detok.output_text), len(self.token_ids)
        return CompletionOutput(
            self.index,
            text,
            tokens,
            self.cumulative_logprob if self.params.logprobs is not None else None,
            logprobs if self.params.logprobs is not None else None,
            self.finish_reason,
            self.stop_reason,
        )


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    children: dict[str, _Child]
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    """Maps engine-core request ids (children) back to user requests."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        core_requests: list[EngineCoreRequest],
        arrival_time: float | None = None,
    ) -> None:
        """Track a user request made of ``core_requests`` (one per sample when n > 1)."""
        first = core_requests[0]
        kind = first.sampling_params.output_kind
        children = {
            r.request_id: _Child(
                i, r.sampling_params, IncrementalDetokenizer(self.tokenizer, r.sampling_params)
            )
            for i, r in enumerate(core_requests)
        }
        self._states[request_id] = _RequestState(
            request_id,
            prompt,
            first.prompt_token_ids,
            kind,
            children,
            RequestMetrics(arrival_time or time.time()),
        )
        for r in core_requests:
            self._child_to_parent[r.request_id] = request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def child_ids(self, request_id: str) -> list[str]:
        state = self._states.get(request_id)
        return list(state.children) if state else []

    def abort_request(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        for child in state.children if state else ():
            self._child_to_parent.pop(child, None)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the user-visible outputs and the engine ids to abort (stop strings)."""
        now = time.time()
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent = self._child_to_parent.get(out.request_id)
            state = self._states.get(parent) if parent else None
            if state is None:
                continue
            child = state.children[out.request_id]
            if child.finish_reason is not None:
                continue
            self._apply(state, child, out, now)
            if child.finish_reason == "stop" and out.finish_reason is None:
                to_abort.append(out.request_id)  # a stop string: the engine must stop too
            touched[parent] = state
        results = []
        for request_id, state in touched.items():
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                self.abort_request(request_id)
            if state.kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            results.append(
                RequestOutput(
                    request_id,
                    state.prompt,
                    state.prompt_token_ids,
                    [c.completion(state.kind) for c in state.children.values()],
                    finished,
                    state.num_cached_tokens,
                    state.metrics,
                )
            )
        return results, to_abort

    def _apply(
        self, state: _RequestState, child: _Child, out: EngineCoreOutput, now: float
    ) -> None:
        m = state.metrics
        if out.new_token_ids:
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            m.num_generation_tokens += len(out.new_token_ids)
        if out.queue_time_s is not None and m.queue_time is None:
            m.queue_time = out.queue_time_s
        state.num_cached_tokens = out.num_cached_tokens
        child.token_ids.extend(out.new_token_ids)
        for lp in out.new_logprobs or ():
            child.logprobs.append(lp)
            child.cumulative_logprob += lp.logprob
        stop_string = child.detok.update(out.new_token_ids)
        if stop_string is not None:
            child.finish_reason, child.stop_reason = "stop", stop_string
        elif out.finish_reason is not None:
            child.finish_reason, child.stop_reason = str(out.finish_reason), out.stop_reason
