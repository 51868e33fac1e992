"""Small helpers every benchmark client shares: base URLs and percentiles."""

from __future__ import annotations

import math

OPENAI_PREFIX = "/v1"


def server_root(base_url: str) -> str:
    """The server's root URL, where ``/metrics`` and ``/health`` live.

    Users pass either the root (``http://127.0.0.1:8000``) or the OpenAI base URL
    (``http://127.0.0.1:8000/v1``, what an OpenAI client is given); both name the same
    server, so a trailing ``/v1`` and trailing slashes are dropped.
    """
    root = base_url.strip().rstrip("/")
    if root.endswith(OPENAI_PREFIX):
        root = root[: -len(OPENAI_PREFIX)].rstrip("/")
    return root


def openai_base_url(base_url: str) -> str:
    """The OpenAI API base URL (``.../v1``) of a server given in either form."""
    return server_root(base_url) + OPENAI_PREFIX


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), ``q`` in [0, 100].

    The one definition behind every P50/P90/P95/P99 we report, so that the study's and
    the serving benchmark's figures mean the same thing. NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
