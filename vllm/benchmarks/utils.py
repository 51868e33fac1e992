"""Small helpers every benchmark client shares: base URLs, percentiles, a quiet machine."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

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


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat (Linux)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_until_quiet(
    threshold: float = 0.15,
    window_s: float = 0.5,
    timeout_s: float = 30.0,
    times: Callable[[], tuple[int, int]] = cpu_times,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Sleep until the machine's CPUs are busy less than ``threshold`` of a ``window_s``
    window (or ``timeout_s`` passed); returns the seconds waited. A server that keeps
    spinning after its burst (upstream vLLM's CPU engine does, for a second or more) would
    otherwise slow whichever engine a side-by-side benchmark measures next."""
    waited = 0.0
    while waited < timeout_s:
        busy0, total0 = times()
        sleep(window_s)
        busy1, total1 = times()
        waited += window_s
        if total1 == total0 or (busy1 - busy0) / (total1 - total0) < threshold:
            break
    return waited
