"""The job-ordered waiting queue in this engine (a policy's ``queue_order == "job"``):
``vllm_continuum.queue.JobOrderQueue`` (job-level FCFS with bounded waiting) over our
``Request`` (its ``job_key`` and ``arrival_time``), as a ``RequestQueue``. Which jobs are
pinned is read from the scheduler's pins (a live view).
"""

from __future__ import annotations

from collections.abc import Callable, Container

from vllm.utils.clock import Clock
from vllm.v1.core.sched.request_queue import KeyOrderedRequestQueue
from vllm.v1.request import Request
from vllm_continuum.queue import JobOrderQueue


def _job_key(request: Request) -> str:
    return request.job_key


def _arrival_time(request: Request) -> float:
    return request.arrival_time


class JobRequestQueue(JobOrderQueue, KeyOrderedRequestQueue):
    def __init__(
        self,
        job_arrival: Callable[[Request], float],
        clock: Clock,
        wait_bound: Callable[[Request], float],
        pinned_jobs: Container[str] = frozenset(),
    ) -> None:
        super().__init__(_job_key, _arrival_time, job_arrival, clock, wait_bound, pinned_jobs)
