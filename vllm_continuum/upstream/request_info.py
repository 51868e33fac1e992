"""An upstream ``Request`` as a policy's ``RequestView``: its job, whether it is the job's last
turn, and its token counts.

They arrive as ``vllm_xargs`` (``SamplingParams.extra_args``); the ``middleware`` module
moves top-level ``job_id`` / ``is_last_step`` there. The job key follows the one rule of
``vllm_continuum.jobs``; the middleware refuses an empty ``job_id`` with a 400. One that
reaches the scheduler anyway (``vllm_xargs`` sent to a server without the middleware)
cannot be refused there without failing the engine: it is logged, and the request is a
job of its own, never joined to another request's job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm_continuum.jobs import LAST_UNLESS_TOOL_CALL, job_key, validate_job_id

logger = logging.getLogger(__name__)

_TRUE = {"1", "true", "yes", "on"}


class RequestInfo:
    """An upstream ``Request`` as the policies' ``RequestView``: the agent fields read once
    at arrival (``arrival_time`` on our clock, not upstream's wall-clock arrival), the
    token counts live from the request."""

    __slots__ = (
        "request",
        "job_key",
        "named",
        "is_last_step",
        "arrival_time",
        "last_unless_tool_call",
    )

    def __init__(
        self,
        request: Any,
        job_key: str,
        named: bool,
        is_last_step: bool,
        arrival_time: float,
        last_unless_tool_call: bool = False,
    ) -> None:
        self.request = request
        self.job_key = job_key
        self.named = named  # carries a user-given job_id
        self.is_last_step = is_last_step
        self.arrival_time = arrival_time
        self.last_unless_tool_call = last_unless_tool_call  # last unless it calls a tool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def num_preemptions(self) -> int:
        return self.request.num_preemptions

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.request.output_token_ids


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
        request,
        job_key=job_key(job_id, request.request_id),
        named=job_id is not None,
        is_last_step=as_bool(extra.get("is_last_step", False)),
        arrival_time=now,
        last_unless_tool_call=as_bool(extra.get(LAST_UNLESS_TOOL_CALL, False)),
    )
