"""The job a request belongs to when the client names it the router's way, not ours.

Behind vLLM's router (``vllm-router``, see docs/router.md) one identity has to do two
jobs: the router's ``consistent_hash`` picks the replica by it, and that replica's
scheduler pins the job's KV between turns by it. The router does not read ``job_id`` or
``prompt_cache_key``; a client that sends neither names its job the router's or vLLM's
way:

1. ``session_id`` in the body: vLLM's "stable session identity shared by related
   requests" (a conversation, an agent session), which vLLM reads from the body, then
   the ``X-Session-ID`` header, then ``vllm_xargs.session_id``;
2. ``vllm_xargs.agentic_context.program_id``: the router's Program identity (its
   ``--enable-program-scheduling`` binds a Program to one replica);
3. the ``X-Session-ID`` header: the first key ``consistent_hash`` hashes on;
4. ``vllm_xargs.session_id``.

``read_headers`` also takes vLLM's other request headers: ``X-Request-Id`` names the
request (over the body's ``request_id``), ``X-Vllm-Priority`` sets its priority.

Precedence: ``job_id`` > ``prompt_cache_key`` > ``session_id`` > ``program_id`` >
``X-Session-ID`` > ``vllm_xargs.session_id``. The router's other keys are not jobs
(``X-User-ID``, ``X-Tenant-ID`` and the body's ``user`` span many jobs; ``X-Request-ID``
and ``X-Trace-ID`` name one request), so they never pin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.entrypoints.openai.protocol import MAX_REQUEST_ID
from vllm.exceptions import VLLMValidationError

SESSION_HEADER = "x-session-id"
REQUEST_ID_HEADER = "x-request-id"
PRIORITY_HEADER = "x-vllm-priority"
PROGRAM_ID_PARAM = "vllm_xargs.agentic_context.program_id"
XARGS_SESSION_PARAM = "vllm_xargs.session_id"


def program_id(vllm_xargs: dict[str, Any] | None) -> str | None:
    """``vllm_xargs.agentic_context.program_id``, if sent; ``VLLMValidationError`` naming
    it if it is not a non-empty string (a Program the router binds must be one job here)."""
    context = (vllm_xargs or {}).get("agentic_context")
    if context is None:
        return None
    if not isinstance(context, dict):
        raise VLLMValidationError(
            "vllm_xargs.agentic_context must be an object", "vllm_xargs.agentic_context"
        )
    value = context.get("program_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise VLLMValidationError(
            f"{PROGRAM_ID_PARAM} must be a non-empty string", PROGRAM_ID_PARAM
        )
    return value


def xargs_session_id(vllm_xargs: dict[str, Any] | None) -> str | None:
    """``vllm_xargs.session_id``, if sent; ``VLLMValidationError`` naming it if it is not
    a non-empty string."""
    value = (vllm_xargs or {}).get("session_id")
    if value is not None and (not isinstance(value, str) or not value):
        raise VLLMValidationError(
            f"{XARGS_SESSION_PARAM} must be a non-empty string", XARGS_SESSION_PARAM
        )
    return value


def name_the_job(request: Any, headers: Mapping[str, str], max_length: int) -> str | None:
    """Set ``request.job_id`` from the session's identity when the request names no job
    (no ``job_id``, no ``prompt_cache_key``); returns where the job id came from
    (``"job_id"``, ``"prompt_cache_key"``, ``"session_id"``, ``PROGRAM_ID_PARAM``,
    ``"X-Session-ID"``, ``XARGS_SESSION_PARAM``), or None for a request of no job.
    ``headers`` is case-insensitive (starlette's).

    ``VLLMValidationError`` naming the source if the identity taken is longer than
    ``max_length`` (the server's ``--max-job-id-length``); an empty header names no job.
    """
    if request.job_id is not None:
        same_as_key = request.job_id == getattr(request, "prompt_cache_key", None)
        return "prompt_cache_key" if same_as_key else "job_id"
    if getattr(request, "prompt_cache_key", None) is not None:
        return "prompt_cache_key"  # the Responses API resolves it with the chain
    xargs = getattr(request, "vllm_xargs", None)
    source, value = "session_id", getattr(request, "session_id", None)
    if value is None:
        source, value = PROGRAM_ID_PARAM, program_id(xargs)
    if value is None:
        source, value = "X-Session-ID", headers.get(SESSION_HEADER) or None
    if value is None:
        source, value = XARGS_SESSION_PARAM, xargs_session_id(xargs)
    if value is None:
        return None
    if len(value) > max_length:
        raise VLLMValidationError(
            f"{source} names the job and must be at most {max_length} characters "
            f"(--max-job-id-length), got {len(value)}",
            source,
        )
    request.job_id = value
    return source


def read_headers(request: Any, headers: Mapping[str, str], max_job_id_length: int) -> str | None:
    """vLLM's request headers: ``X-Request-Id`` names the request, ``X-Vllm-Priority``
    sets its priority (each over the body's field), then ``name_the_job``; returns where
    the job id came from. ``VLLMValidationError`` naming the header if one is malformed."""
    request_id = headers.get(REQUEST_ID_HEADER)
    if request_id:
        if len(request_id) > MAX_REQUEST_ID:
            raise VLLMValidationError(
                f"X-Request-Id must be at most {MAX_REQUEST_ID} characters, got {len(request_id)}",
                "X-Request-Id",
            )
        request.request_id = request_id
    priority = headers.get(PRIORITY_HEADER)
    if priority is not None:
        try:
            request.priority = int(priority)
        except ValueError:
            raise VLLMValidationError(
                "X-Vllm-Priority must be an integer", "X-Vllm-Priority"
            ) from None
    return name_the_job(request, headers, max_job_id_length)
