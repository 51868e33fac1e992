"""A third policy, written once against ``vllm_continuum.policy`` and run by both engines'
tests (tests/v1/core/sched/test_new_policy.py, tests_upstream/test_new_policy.py): it
proves that a policy is one file plus one registry line (here ``register_policy``).

Newest job first (the opposite of Continuum's order), the oldest job preempted first, and
every named turn that is not its job's last kept pinned for ``PIN_S`` seconds."""

from __future__ import annotations

from vllm_continuum.policy import FREE, FinishedAction, Pin, Policy, RequestView

PIN_S = 1.0


class NewestJobFirst(Policy):
    name = "newest_job_first"
    queue_order = "job"  # the job-ordered queue, keyed by job_arrival (smallest first)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first_arrival: dict[str, float] = {}
        self.events: list[tuple[str, str]] = []  # (event, request id): what the test reads

    def job_arrival(self, request: RequestView) -> float:
        # The newest job has the smallest key, so the job order serves it first.
        return -self.first_arrival.get(request.job_key, request.arrival_time)

    def victim_key(self, request: RequestView) -> float:
        return self.job_arrival(request)  # the oldest job's request is preempted first

    def on_arrival(self, request: RequestView, now: float) -> None:
        self.first_arrival.setdefault(request.job_key, request.arrival_time)
        self.events.append(("arrival", request.request_id))

    def on_scheduled(self, request: RequestView, hit: int, now: float) -> None:
        self.events.append(("scheduled", request.request_id))

    def on_finished(self, request: RequestView, now: float) -> FinishedAction:
        self.events.append(("finished", request.request_id))
        if request.named and not request.is_last_step:
            return Pin(PIN_S)
        return FREE

    def on_pin_released(self, request: RequestView, now: float, reason: str) -> None:
        self.events.append((f"pin_{reason}", request.request_id))
