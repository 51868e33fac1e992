"""Continuum's decisions (arXiv 2511.02230), free of any engine's request type.

``ContinuumCore`` learns tool durations from a job's departures and next arrivals, parses
the tool call of a finished turn, and decides how long to pin the turn's KV blocks (the
paper's TTL rule, or the research fork's fixed rule). An engine binding calls it with
plain values; the pins themselves (holding, expiring, releasing blocks) are the
binding's mechanism. Jobs are identified by a *job key*: the request's ``job_id``, or a
per-request key for requests without one (they are their own job).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from vllm_continuum.admission import JobAdmission
from vllm_continuum.clock import Clock
from vllm_continuum.estimator import ToolCallEstimator
from vllm_continuum.recorder import JobRecorder
from vllm_continuum.tool_calls import ToolCall, ToolCallParser
from vllm_continuum.ttl import eta_from_turns, fit_prefill_profile, optimal_ttl, prefill_time
from vllm_continuum.turns import FinishedTurn

if TYPE_CHECKING:
    from vllm_continuum.config import PolicyConfig

logger = logging.getLogger(__name__)

MIN_PIN_S = 0.01  # shorter pins are not worth the bookkeeping


class ContinuumCore:
    """The state and decisions of one Continuum policy instance (one engine)."""

    def __init__(self, config: PolicyConfig, clock: Clock, record_dir: str | None = None) -> None:
        """``record_dir``: where to write the per-job event log (None: no log)."""
        self.config = config
        self.clock = clock
        self.parser = ToolCallParser()
        self.estimator = ToolCallEstimator()
        self.prefill_coeffs = fit_prefill_profile([])
        self.queue_delays: deque[float] = deque(maxlen=config.queue_delay_window)
        self.recorder = JobRecorder(record_dir, clock) if record_dir else None
        self.admission = JobAdmission(config.job_idle_timeout_s)
        # Per-job lines follow the server's request logging (job ids escaped by %r).
        self.log = logger.info if config.log_jobs else logger.debug

    def set_prefill_profile(self, samples: Sequence[tuple[int, float]]) -> None:
        """(tokens, seconds) prefill measurements, to price a re-prefill."""
        self.prefill_coeffs = fit_prefill_profile(samples)

    def job_arrival(self, job: str, default: float) -> float:
        """The job's first arrival (``default`` for a job not seen yet)."""
        return self.estimator.job_first_arrival(job, default)

    # -- events ---------------------------------------------------------------------------
    def on_arrival(
        self, job: str, request_id: str, now: float, named: bool, prompt_tokens: int
    ) -> None:
        """A turn arrived; ``named``: it carries a user-given job_id."""
        last_tool = self.estimator.on_arrival(job, now)
        self.admission.on_arrival(job, prompt_tokens, now)
        if named:
            self.log("job %r arriving, last func call: %s", job, last_tool)
        self._record(job, "arrival", request=request_id, last_func_call=last_tool)

    def on_scheduled(
        self,
        job: str,
        request_id: str,
        now: float,
        queued_s: float,
        context_kept: bool,
        hit: int,
        num_tokens: int,
    ) -> None:
        """A turn of ``num_tokens`` was admitted after ``queued_s`` in the queue;
        ``context_kept``: its job's context was pinned (or it is a preempted request
        coming back)."""
        self.admission.on_scheduled(job, num_tokens, now)
        if not context_kept:
            # A turn whose context was not kept waited this long: the T of the TTL rule.
            self.queue_delays.append(max(queued_s, 0.0))
        self._record(job, "scheduled", request=request_id, hit_length=hit)

    def on_finished(self, turn: FinishedTurn) -> float:
        """A turn finished: the pin's TTL in seconds (0: free)."""
        call, is_last_step = self.depart(turn)
        job, tool = turn.job, call.name if call else None
        self._record(
            job, "departure", request=turn.request_id, func_call=tool, is_last_step=is_last_step
        )
        if is_last_step:
            return 0.0
        if not turn.named:
            return 0.0  # no later turn can be matched to it
        ttl = self.ttl_for(turn.num_tokens, tool)
        if ttl < MIN_PIN_S:
            self.log("job %r: func_call=%s -> no pin", job, tool)
            return 0.0
        self.log("job %r: func_call=%s -> pin %.2fs", job, tool, ttl)
        self._record(job, "pinned", request=turn.request_id, ttl_s=ttl)
        return ttl

    def depart(self, turn: FinishedTurn) -> tuple[ToolCall | None, bool]:
        """The bookkeeping of a finished turn (tool call, departure time, job end, memory
        accounting), shared by every policy built on this core: its tool call, and whether
        it ended the job (``is_last_step``, or no tool call where the client said
        ``last_unless_tool_call``)."""
        call = self.parser.parse(turn.text)
        is_last_step = turn.is_last_step or (turn.last_unless_tool_call and call is None)
        self.admission.on_stopped(
            turn.job, turn.num_tokens, is_last_step, turn.now, self.config.max_ttl_s
        )
        self.estimator.on_departure(turn.job, turn.now, call.name if call else None)
        if is_last_step:
            self.estimator.on_job_end(turn.job)
        return call, is_last_step

    def on_kv_released(self, job: str, num_tokens: int, now: float) -> None:
        """A turn left the engine's memory without finishing (preempted or aborted)."""
        self.admission.on_stopped(job, num_tokens, False, now, self.config.max_ttl_s)

    # -- job-level admission and pressure -------------------------------------------------
    def wait_bound_s(self, job: str) -> float:
        """How long a waiting turn of ``job`` may wait before it is served regardless of
        job order: a new job's first turn waits for memory up to the admission bound."""
        cfg = self.config
        new_job = cfg.job_admission and not self.admission.is_known(job)
        return cfg.job_admission_max_wait_s if new_job else cfg.max_wait_s

    def may_admit(
        self,
        job: str,
        new_tokens: int,
        free_tokens: int,
        pinned_jobs: Container[str],
        waited_s: float,
        now: float,
    ) -> bool:
        """Whether a turn of ``job`` needing ``new_tokens`` may start now. Turns of jobs
        already started always may (their memory is what admission protects)."""
        if not self.config.job_admission or self.admission.is_known(job):
            return True
        if waited_s > self.config.job_admission_max_wait_s:
            return True
        return self.admission.admits(new_tokens, free_tokens, pinned_jobs, now)

    def may_release_pin(
        self, requester_job_arrival: float, pin_job_arrival: float, waited_s: float
    ) -> bool:
        """A pin of an older job is not torn down for a newer job's turn (unless that turn
        has waited past the bound): pressure releases go from newer jobs' pins."""
        return pin_job_arrival > requester_job_arrival or waited_s > self.config.max_wait_s

    def on_pin_released(self, job: str, request_id: str, reason: str) -> None:
        self._record(job, "unpinned", request=request_id, reason=reason)

    def shutdown(self) -> None:
        if self.recorder is not None:
            self.recorder.flush()

    # -- the TTL --------------------------------------------------------------------------
    def ttl_for(self, num_tokens: int, tool: str | None) -> float:
        """Pin length for a context of ``num_tokens`` whose job now runs ``tool``."""
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
        return optimal_ttl(durations, self.gain_s(num_tokens), cfg.max_ttl_s)

    def gain_s(self, num_tokens: int) -> float:
        """What a pin hit saves: T * eta + the time to re-prefill this context."""
        delay = sum(self.queue_delays) / len(self.queue_delays) if self.queue_delays else 0.0
        eta = eta_from_turns(self.estimator.turn_pairs())
        return delay * eta + prefill_time(self.prefill_coeffs, num_tokens)

    def _record(self, job: str, event: str, **fields) -> None:
        if self.recorder is not None:
            self.recorder.record(job, event, **fields)
