"""Continuum: job-level FCFS, and KV pins with a TTL while an agent's tool runs."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

from vllm.config import PolicyConfig
from vllm.utils.clock import Clock, monotonic_clock
from vllm.v1.core.estimate_with_func import ToolCall, ToolCallEstimator, ToolCallParser
from vllm.v1.core.job_recorder import JobRecorder
from vllm.v1.core.sched.continuum_queue import ContinuumRequestQueue
from vllm.v1.core.sched.pinned import job_key
from vllm.v1.core.sched.policy.base import (
    FREE,
    PIN_RELEASE_REPLACED,
    FinishedAction,
    Pin,
    Policy,
)
from vllm.v1.core.ttl import eta_from_turns, fit_prefill_profile, optimal_ttl, prefill_time
from vllm.v1.request import Request

logger = logging.getLogger(__name__)

MIN_PIN_S = 0.01  # shorter pins are not worth the bookkeeping


class ContinuumPolicy(Policy):
    name = "continuum"

    def __init__(
        self,
        config: PolicyConfig | None = None,
        decode: Callable[[list[int]], str] | None = None,
        clock: Clock = monotonic_clock,
    ) -> None:
        super().__init__(config, decode)
        self.clock = clock
        self.parser = ToolCallParser()
        self.estimator = ToolCallEstimator()
        self.queue: ContinuumRequestQueue | None = None
        self.prefill_coeffs = fit_prefill_profile([])
        self.queue_delays: deque[float] = deque(maxlen=self.config.queue_delay_window)
        self.recorder = JobRecorder.from_env(clock)
        self._pinned_jobs: set[str] = set()

    # -- seam -----------------------------------------------------------------------------
    def create_request_queue(self) -> ContinuumRequestQueue:
        self.queue = ContinuumRequestQueue(self._job_arrival, self.clock, self.config.max_wait_s)
        return self.queue

    def set_prefill_profile(self, samples: Sequence[tuple[int, float]]) -> None:
        """(tokens, seconds) prefill measurements from the model runner at start-up."""
        self.prefill_coeffs = fit_prefill_profile(samples)

    def _job_arrival(self, request: Request) -> float:
        return self.estimator.job_first_arrival(job_key(request), request.arrival_time)

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The newest job's request; last-step requests only when nothing else is left."""
        return max(
            running, key=lambda r: (not r.is_last_step, self._job_arrival(r), r.arrival_time)
        )

    def on_arrival(self, request: Request, now: float) -> None:
        job = job_key(request)
        last_tool = self.estimator.on_arrival(job, now)
        if request.job_id is not None:
            logger.info("job %s arriving, last func call: %s", request.job_id, last_tool)
        self._record(job, "arrival", request=request.request_id, last_func_call=last_tool)

    def on_scheduled(self, request: Request, now: float) -> None:
        job = job_key(request)
        if job not in self._pinned_jobs and request.num_preemptions == 0:
            # A turn whose context was not kept waited this long: the T of the TTL rule.
            self.queue_delays.append(max(now - request.arrival_time, 0.0))
        self._record(
            job,
            "scheduled",
            request=request.request_id,
            hit_length=max(request.num_cached_tokens, 0),
        )

    def on_finished(self, request: Request, now: float) -> FinishedAction:
        job = job_key(request)
        call = self._parse(request)
        tool = call.name if call else None
        self.estimator.on_departure(job, now, tool)
        self._record(
            job,
            "departure",
            request=request.request_id,
            func_call=tool,
            is_last_step=request.is_last_step,
        )
        if request.is_last_step:
            self.estimator.on_job_end(job)
            return FREE
        if request.job_id is None:
            return FREE  # no later turn can be matched to it
        ttl = self.ttl_for(request, tool)
        if ttl < MIN_PIN_S:
            logger.info("job %s: func_call=%s -> no pin", request.job_id, tool)
            return FREE
        logger.info("job %s: func_call=%s -> pin %.2fs", request.job_id, tool, ttl)
        self._pinned_jobs.add(job)
        if self.queue is not None:
            self.queue.set_job_pinned(job, True)
        self._record(job, "pinned", request=request.request_id, ttl_s=ttl)
        return Pin(ttl)

    def on_pin_released(self, request: Request, now: float, reason: str) -> None:
        job = job_key(request)
        if reason != PIN_RELEASE_REPLACED:  # else a newer pin of the job holds on
            self._pinned_jobs.discard(job)
            if self.queue is not None:
                self.queue.set_job_pinned(job, False)
        self._record(job, "unpinned", request=request.request_id, reason=reason)

    def shutdown(self) -> None:
        if self.recorder is not None:
            self.recorder.flush()

    # -- decisions ------------------------------------------------------------------------
    def _parse(self, request: Request) -> ToolCall | None:
        if self.decode is None or not request.output_token_ids:
            return None
        return self.parser.parse(self.decode(request.output_token_ids))

    def ttl_for(self, request: Request, tool: str | None) -> float:
        cfg = self.config
        if cfg.continuum_ttl_mode == "fixed":
            if tool is None:
                return 0.0
            mean = self.estimator.mean(tool)  # an unseen tool counts as instant
            return cfg.fixed_pin_s if (mean or 0.0) <= cfg.fixed_threshold_s else 0.0
        if self.estimator.num_records <= cfg.min_records:
            return min(cfg.default_ttl_s, cfg.max_ttl_s)
        own = self.estimator.durations(tool)
        durations = own if len(own) > cfg.min_records else self.estimator.all_durations()
        return optimal_ttl(durations, self.gain_s(request), cfg.max_ttl_s)

    def gain_s(self, request: Request) -> float:
        """What a pin hit saves: T * eta + the time to re-prefill this context."""
        delay = sum(self.queue_delays) / len(self.queue_delays) if self.queue_delays else 0.0
        eta = eta_from_turns(self.estimator.turn_pairs())
        return delay * eta + prefill_time(self.prefill_coeffs, request.num_tokens)

    def _record(self, job: str, event: str, **fields) -> None:
        if self.recorder is not None:
            self.recorder.record(job, event, **fields)
