"""The one rule for a request's job, shared by every engine binding.

A request names its job with a non-empty string ``job_id``; without one it is a job of its
own (no later turn can be matched to it, so it is never pinned). An empty ``job_id`` names
nothing and is refused where it enters: a 400 on a server, a ``ValueError`` offline.
"""

from __future__ import annotations

from typing import Any

UNNAMED_PREFIX = "request:"  # the job key of a request without a job_id
# extra_args key: the job ends with this turn unless its output calls a tool.
LAST_UNLESS_TOOL_CALL = "last_step_unless_tool_call"


def validate_job_id(job_id: Any) -> str | None:
    """``job_id`` itself if it is None or a non-empty string; else ``ValueError`` naming it."""
    if job_id is None:
        return None
    if not isinstance(job_id, str):
        raise ValueError(f"job_id must be a string, got {job_id!r}")
    if not job_id:
        raise ValueError("job_id must not be empty (omit it for a request of its own)")
    return job_id


def job_key(job_id: str | None, request_id: str) -> str:
    """The key a request's job is known by: its job_id, or the request itself."""
    return job_id if job_id is not None else f"{UNNAMED_PREFIX}{request_id}"
