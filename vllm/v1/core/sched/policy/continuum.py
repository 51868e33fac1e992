"""Continuum in this engine: the binding of ``vllm_continuum.ContinuumCore`` to our
scheduler's policy seam (job-level FCFS queue, newest-job victims, TTL pins)."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from vllm import envs
from vllm.config import PolicyConfig
from vllm.utils.clock import Clock, monotonic_clock
from vllm.v1.core.sched.continuum_queue import ContinuumRequestQueue
from vllm.v1.core.sched.policy.base import FREE, FinishedAction, Pin, Policy
from vllm.v1.request import Request
from vllm_continuum.continuum import ContinuumCore
from vllm_continuum.job_order import victim_key
from vllm_continuum.turns import FinishedTurn


class ContinuumPolicy(Policy):
    name = "continuum"
    needs_decode = True

    def __init__(
        self,
        config: PolicyConfig | None = None,
        decode: Callable[[list[int]], str] | None = None,
        clock: Clock = monotonic_clock,
        has_kv_tier: bool = False,
    ) -> None:
        super().__init__(config, decode, clock, has_kv_tier)
        self.core = self._make_core()
        self.queue: ContinuumRequestQueue | None = None
        self._pinned_jobs: Container[str] = frozenset()

    def _make_core(self) -> ContinuumCore:
        """The engine-agnostic decisions this binding drives (subclasses extend them)."""
        return ContinuumCore(self.config, self.clock, record_dir=envs.RUN_OUTPUT_DIR)

    def create_request_queue(self, pinned_jobs: Container[str]) -> ContinuumRequestQueue:
        self._pinned_jobs = pinned_jobs
        self.queue = ContinuumRequestQueue(
            self.job_arrival, self.clock, self._wait_bound, pinned_jobs
        )
        return self.queue

    def prepare(self, measure_prefill: Callable[[], Sequence[tuple[int, float]]]) -> None:
        self.core.set_prefill_profile(measure_prefill())

    def job_arrival(self, request: Request) -> float:
        return self.core.job_arrival(request.job_key, request.arrival_time)

    def _wait_bound(self, request: Request) -> float:
        return self.core.wait_bound_s(request.job_key)

    # -- job-level admission and pressure (vllm_continuum.admission) ----------------------
    def may_admit(self, request: Request, new_tokens: int, free_tokens: int, now: float) -> bool:
        waited = now - request.arrival_time
        return self.core.may_admit(
            request.job_key, new_tokens, free_tokens, self._pinned_jobs, waited, now
        )

    def may_release_pins_for(
        self, request: Request, own_job_pinned: bool, num_running: int, now: float
    ) -> bool:
        if not self.config.job_admission:
            return super().may_release_pins_for(request, own_job_pinned, num_running, now)
        return True  # which pins it may take is decided pin by pin (may_release_pin)

    def may_release_pin(self, requester: Request, pin_job_arrival: float, now: float) -> bool:
        if not self.config.job_admission:
            return True
        waited = now - requester.arrival_time
        return self.core.may_release_pin(self.job_arrival(requester), pin_job_arrival, waited)

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The newest job's request; last-step requests only when nothing else is left."""
        return max(
            running,
            key=lambda r: victim_key(r.is_last_step, self.job_arrival(r), r.arrival_time),
        )

    def on_arrival(self, request: Request, now: float) -> None:
        named = request.job_id is not None
        self.core.on_arrival(
            request.job_key, request.request_id, now, named, request.num_prompt_tokens
        )

    def on_scheduled(self, request: Request, now: float) -> None:
        kept = request.job_key in self._pinned_jobs or request.num_preemptions > 0
        self.core.on_scheduled(
            request.job_key,
            request.request_id,
            now,
            queued_s=now - request.arrival_time,
            context_kept=kept,
            hit=max(request.num_cached_tokens, 0),
            num_tokens=request.num_tokens,
        )

    def on_finished(self, request: Request, now: float) -> FinishedAction:
        ttl = self.core.on_finished(self._finished_turn(request, now))
        return Pin(ttl) if ttl > 0 else FREE

    def _finished_turn(self, request: Request, now: float) -> FinishedTurn:
        """A finished request as the core's plain values (its output decoded to text)."""
        text = None
        if self.decode is not None and request.output_token_ids:
            text = self.decode(request.output_token_ids)
        return FinishedTurn(
            job=request.job_key,
            request_id=request.request_id,
            now=now,
            text=text,
            is_last_step=request.is_last_step,
            named=request.job_id is not None,
            num_tokens=request.num_tokens,
            last_unless_tool_call=request.sampling_params.last_step_unless_tool_call,
        )

    def on_preempted(self, request: Request, now: float) -> None:
        self.core.on_kv_released(request.job_key, request.num_tokens, now)

    def on_aborted(self, request: Request, was_running: bool, now: float) -> None:
        if was_running:
            self.core.on_kv_released(request.job_key, request.num_tokens, now)

    def on_pinned(self, request: Request, now: float) -> None:
        if self.queue is not None:
            self.queue.job_pin_changed(request.job_key)

    def on_pin_released(self, request: Request, now: float, reason: str) -> None:
        if self.queue is not None:
            self.queue.job_pin_changed(request.job_key)
        self.core.on_pin_released(request.job_key, request.request_id, reason)

    def shutdown(self) -> None:
        self.core.shutdown()
