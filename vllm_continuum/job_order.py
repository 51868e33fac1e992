"""Job-level ordering keys of the Continuum paper: every engine binding sorts with these.

A job's requests rank by the job's *first* arrival, so turn 5 of an old job beats turn 1
of a new one; a job that holds pinned blocks ranks before all others (its context is
already in memory: serving it frees the pin). Smaller keys go first.
"""

from __future__ import annotations


def waiting_key(job_pinned: bool, job_arrival: float, arrival: float) -> tuple[bool, float, float]:
    """Admission order of a waiting request (smallest first)."""
    return (not job_pinned, job_arrival, arrival)


def victim_key(is_last_step: bool, job_arrival: float, arrival: float) -> tuple[bool, float, float]:
    """Preemption order of a running request (largest first): the newest job's request,
    and a job's last step only when nothing else is left (it is about to free everything)."""
    return (not is_last_step, job_arrival, arrival)
