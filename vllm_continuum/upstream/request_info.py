"""The agent fields of an upstream ``Request``: its job and whether it is the job's last turn.

They arrive as ``vllm_xargs`` (``SamplingParams.extra_args``); the ``middleware`` module
moves top-level ``job_id`` / ``is_last_step`` there. A request without a ``job_id`` is its
own job (no later turn can be matched to it, so it is never pinned).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class RequestInfo:
    """What the policies need of a request, read once at arrival (our clock's time)."""

    job: str
    named: bool  # carries a user-given job_id
    is_last_step: bool
    arrival: float


def as_bool(value: Any) -> bool:
    """``vllm_xargs`` values are str/int/float: accept true/1/"true"/"yes"."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)


def request_info(request: Any, now: float) -> RequestInfo:
    params = getattr(request, "sampling_params", None)
    extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
    job_id = extra.get("job_id")
    named = job_id is not None and str(job_id) != ""
    return RequestInfo(
        job=str(job_id) if named else f"request:{request.request_id}",
        named=named,
        is_last_step=as_bool(extra.get("is_last_step", False)),
        arrival=now,
    )
