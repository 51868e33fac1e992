"""The OpenAI API's prompt-caching hints, as pin decisions every engine binding applies.

An agent built on the official client says how long it wants its context kept with the
API's own fields; the server turns them into two per-request values in
``SamplingParams.extra_args``:

- ``cache_ttl_s`` (from ``prompt_cache_options.ttl``): a *floor* on the pin of a turn that
  is not the job's last. The policy's own TTL is raised to it, capped by the server's
  ``--continuum-max-ttl``; the pin is soft, so memory pressure still releases it in the
  policy's order before anyone is preempted.
- ``cache_retention`` (from ``prompt_cache_retention``): ``24h`` keeps a context past its
  pin in the host-memory KV tier when there is one (the engines' default); ``in_memory``
  keeps it in the engine's pool only: an ended pin or an ``Offload`` is a plain free.
"""

from __future__ import annotations

import math
from typing import Any

TTL_KEY = "cache_ttl_s"
RETENTION_KEY = "cache_retention"
RETENTIONS = ("in_memory", "24h")


def validate_cache_hints(extra_args: dict[str, Any]) -> None:
    """``ValueError`` naming the key whose value is not a hint we can honour."""
    ttl = extra_args.get(TTL_KEY)
    numeric = isinstance(ttl, int | float) and not isinstance(ttl, bool)
    if ttl is not None and not (numeric and math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"{TTL_KEY} must be a finite number of seconds > 0, got {ttl!r}")
    retention = extra_args.get(RETENTION_KEY)
    if retention is not None and retention not in RETENTIONS:
        choices = ", ".join(RETENTIONS)
        raise ValueError(f"{RETENTION_KEY} must be one of {choices}, got {retention!r}")


def ttl_with_floor(ttl_s: float, floor_s: float | None, max_ttl_s: float) -> float:
    """The TTL of a turn's pin: the policy's ``ttl_s`` (0: no pin) raised to the client's
    floor, the floor capped by ``max_ttl_s``."""
    if floor_s is None:
        return ttl_s
    return max(ttl_s, min(floor_s, max_ttl_s))


def may_offload(extra_args: dict[str, Any] | None) -> bool:
    """Whether a context may go to the host-memory tier once the pool lets it go."""
    return (extra_args or {}).get(RETENTION_KEY) != "in_memory"
