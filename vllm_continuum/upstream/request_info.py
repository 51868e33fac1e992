"""The agent fields of an upstream ``Request``: its job and whether it is the job's last turn.

They arrive as ``vllm_xargs`` (``SamplingParams.extra_args``); the ``middleware`` module
moves top-level ``job_id`` / ``is_last_step`` there. The job key follows the one rule of
``vllm_continuum.jobs``; the middleware refuses an empty ``job_id`` with a 400. One that
reaches the scheduler anyway (``vllm_xargs`` sent to a server without the middleware)
cannot be refused there without failing the engine: it is logged, and the request is a
job of its own, never joined to another request's job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL, job_key, validate_job_id

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}


@dataclass(frozen=True)
class RequestInfo:
    """What the policies need of a request, read once at arrival (our clock's time)."""

    job: str
    named: bool  # carries a user-given job_id
    is_last_step: bool
    arrival: float
    last_unless_tool_call: bool = False  # the job ends here unless the output calls a tool


def as_bool(value: Any) -> bool:
    """``vllm_xargs`` values are str/int/float: accept true/1/"true"/"yes"."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)


def request_info(request: Any, now: float) -> RequestInfo:
    params = getattr(request, "sampling_params", None)
    extra = (getattr(params, "extra_args", None) or {}) if params is not None else {}
    job_id = extra.get("job_id")
    if isinstance(job_id, (int, float)) and not isinstance(job_id, bool):
        job_id = str(job_id)  # vllm_xargs turns a numeric-looking id into a number
    try:
        job_id = validate_job_id(job_id)
    except ValueError as e:
        logger.warning("request %s: %s; served as a job of its own", request.request_id, e)
        job_id = None
    return RequestInfo(
        job=job_key(job_id, request.request_id),
        named=job_id is not None,
        is_last_step=as_bool(extra.get("is_last_step", False)),
        arrival=now,
        last_unless_tool_call=as_bool(extra.get(LAST_UNLESS_TOOL_CALL, False)),
    )
