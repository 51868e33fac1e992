"""Continuum (arXiv 2511.02230) as a policy: ``ContinuumCore``'s decisions over the seam.

Job-level FCFS order with bounded waiting, newest-job victims (last-step requests last),
TTL pins while a job's tool runs, and opt-in job-level admission. The same object runs in
our engine and, through the plugin, in upstream vLLM's scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm_continuum.continuum import ContinuumCore
from vllm_continuum.job_order import victim_key
from vllm_continuum.policy.base import FREE, FinishedAction, Pin, Policy, RequestView
from vllm_continuum.turns import FinishedTurn


class ContinuumPolicy(Policy):
    name = "continuum"
    queue_order = "job"
    needs_decode = True
    wants_kv_tier = True  # a released or expired pin goes to the tier, not away

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``Policy``'s arguments."""
        super().__init__(*args, **kwargs)
        self.core = self._make_core()

    def _make_core(self) -> ContinuumCore:
        """The engine-agnostic decisions this policy drives (subclasses extend them)."""
        return ContinuumCore(self.config, self.clock, record_dir=self.settings.record_dir)

    def prepare(self, measure_prefill: Callable[[], Sequence[tuple[int, float]]]) -> None:
        self.core.set_prefill_profile(measure_prefill())

    def job_arrival(self, request: RequestView) -> float:
        return self.core.job_arrival(request.job_key, request.arrival_time)

    def wait_bound(self, request: RequestView) -> float:
        return self.core.wait_bound_s(request.job_key)

    def victim_key(self, request: RequestView) -> tuple:
        """The newest job's request first; last-step requests only when nothing else is
        left."""
        return victim_key(request.is_last_step, self.job_arrival(request), request.arrival_time)

    # -- job-level admission and pressure (vllm_continuum.admission) ----------------------
    def may_admit(
        self, request: RequestView, new_tokens: int, free_tokens: int, now: float
    ) -> bool:
        waited = now - request.arrival_time
        return self.core.may_admit(
            request.job_key, new_tokens, free_tokens, self.pinned_jobs, waited, now
        )

    def may_release_pins_for(
        self, request: RequestView, own_job_pinned: bool, num_running: int, now: float
    ) -> bool:
        if not self.config.job_admission:
            return super().may_release_pins_for(request, own_job_pinned, num_running, now)
        return True  # which pins it may take is decided pin by pin (may_release_pin)

    def may_release_pin(self, requester: RequestView, pin_job_arrival: float, now: float) -> bool:
        if not self.config.job_admission:
            return True
        waited = now - requester.arrival_time
        return self.core.may_release_pin(self.job_arrival(requester), pin_job_arrival, waited)

    # -- events ---------------------------------------------------------------------------
    def on_arrival(self, request: RequestView, now: float) -> None:
        self.core.on_arrival(
            request.job_key, request.request_id, now, request.named, request.num_prompt_tokens
        )

    def on_scheduled(self, request: RequestView, hit: int, now: float) -> None:
        kept = request.job_key in self.pinned_jobs or request.num_preemptions > 0
        self.core.on_scheduled(
            request.job_key,
            request.request_id,
            now,
            queued_s=now - request.arrival_time,
            context_kept=kept,
            hit=max(hit, 0),
            num_tokens=request.num_tokens,
        )

    def on_finished(self, request: RequestView, now: float) -> FinishedAction:
        ttl = self.core.on_finished(self.finished_turn(request, now))
        return Pin(ttl) if ttl > 0 else FREE

    def finished_turn(self, request: RequestView, now: float) -> FinishedTurn:
        """A finished request as the core's plain values (its output decoded to text)."""
        text = None
        if self.decode is not None and request.output_token_ids:
            text = self.decode(list(request.output_token_ids))
        return FinishedTurn(
            job=request.job_key,
            request_id=request.request_id,
            now=now,
            text=text,
            is_last_step=request.is_last_step,
            named=request.named,
            num_tokens=request.num_tokens,
            last_unless_tool_call=request.last_unless_tool_call,
        )

    def on_preempted(self, request: RequestView, now: float) -> None:
        self.core.on_kv_released(request.job_key, request.num_tokens, now)

    def on_aborted(self, request: RequestView, was_running: bool, now: float) -> None:
        if was_running:
            self.core.on_kv_released(request.job_key, request.num_tokens, now)

    def on_pin_released(self, request: RequestView, now: float, reason: str) -> None:
        self.core.on_pin_released(request.job_key, request.request_id, reason)

    def shutdown(self) -> None:
        self.core.shutdown()
