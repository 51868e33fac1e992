"""The job a request belongs to when the client names it the router's way, not ours.

Behind vLLM's router (``vllm-router``, see docs/router.md) one identity has to do two
jobs: the router's ``consistent_hash`` picks the replica by it, and that replica's
scheduler pins the job's KV between turns by it. The router does not read ``job_id`` or
``prompt_cache_key``; a client that sends neither names its job the router's way:

1. ``vllm_xargs.agentic_context.program_id``: the router's Program identity (its
   ``--enable-program-scheduling`` binds a Program to one replica);
2. the ``X-Session-ID`` header: the first key ``consistent_hash`` hashes on.

Precedence: ``job_id`` > ``prompt_cache_key`` > ``program_id`` > ``X-Session-ID``. The
router's other keys are not jobs (``X-User-ID``, ``X-Tenant-ID`` and the body's ``user``
span many jobs; ``X-Request-ID`` and ``X-Trace-ID`` name one request), so they never pin.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.exceptions import VLLMValidationError

SESSION_HEADER = "x-session-id"
PROGRAM_ID_PARAM = "vllm_xargs.agentic_context.program_id"


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


def name_the_job(request: Any, headers: Mapping[str, str], max_length: int) -> str | None:
    """Set ``request.job_id`` from the router's identity when the request names no job
    (no ``job_id``, no ``prompt_cache_key``); returns where the job id came from
    (``"job_id"``, ``"prompt_cache_key"``, ``PROGRAM_ID_PARAM``, ``"X-Session-ID"``), or
    None for a request of no job. ``headers`` is case-insensitive (starlette's).

    ``VLLMValidationError`` naming the source if the identity taken is longer than
    ``max_length`` (the server's ``--max-job-id-length``); an empty header names no job.
    """
    if request.job_id is not None:
        same_as_key = request.job_id == getattr(request, "prompt_cache_key", None)
        return "prompt_cache_key" if same_as_key else "job_id"
    if getattr(request, "prompt_cache_key", None) is not None:
        return "prompt_cache_key"  # the Responses API resolves it with the chain
    source, value = PROGRAM_ID_PARAM, program_id(getattr(request, "vllm_xargs", None))
    if value is None:
        source, value = "X-Session-ID", headers.get(SESSION_HEADER) or None
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
