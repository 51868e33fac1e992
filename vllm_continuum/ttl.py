"""The TTL rule of Continuum (arXiv 2511.02230, section 4), as pure functions.

Pinning a finished turn for tau seconds costs tau (in units where the pin cost is the
pinned memory share times tau) and pays off if the tool returns within tau, which
happens with probability P(tau, f), the empirical CDF of tool f's past durations. What
a hit saves is the next turn's re-prefill (or reload) time plus the queueing delay
that evicted requests suffer, scaled by eta (how predictably a job's remaining turns
shrink). So tau* = argmax over tau in {0} U {recorded durations} of
P(tau, f) * (T * eta + PrefillReload(r)) - tau.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


def empirical_cdf(sorted_samples: Sequence[float], tau: float) -> float:
    """Fraction of samples <= tau."""
    if not sorted_samples:
        return 0.0
    return bisect.bisect_right(sorted_samples, tau) / len(sorted_samples)


def optimal_ttl(durations: Sequence[float], gain_s: float, max_ttl_s: float) -> float:
    """argmax over the candidates of P(tau) * gain - tau (0 when nothing beats 0)."""
    samples = sorted(d for d in durations if d >= 0)
    if not samples or gain_s <= 0:
        return 0.0
    best_tau, best_value = 0.0, empirical_cdf(samples, 0.0) * gain_s
    n = len(samples)
    for i, tau in enumerate(samples):
        if tau > max_ttl_s:
            break
        if i + 1 < n and samples[i + 1] == tau:
            continue  # evaluate each distinct value once, with all its ties counted
        value = (i + 1) / n * gain_s - tau
        if value > best_value:
            best_tau, best_value = tau, value
    return best_tau


def eta_from_turns(pairs: Sequence[tuple[int, int]], default: float = 1.0) -> float:
    """eta = -Corr(k, N - k) over (turn index, remaining turns) pairs, clamped to [0, 1]."""
    if len(pairs) < 3:
        return default
    ks = [float(k) for k, _ in pairs]
    rs = [float(r) for _, r in pairs]
    mk, mr = sum(ks) / len(ks), sum(rs) / len(rs)
    cov = sum((k - mk) * (r - mr) for k, r in zip(ks, rs, strict=True))
    vk = sum((k - mk) ** 2 for k in ks)
    vr = sum((r - mr) ** 2 for r in rs)
    if vk == 0 or vr == 0:
        return default
    return min(max(-cov / math.sqrt(vk * vr), 0.0), 1.0)


def fit_prefill_profile(samples: Sequence[tuple[int, float]]) -> tuple[float, float, float]:
    """Least-squares a + b*n + c*n^2 through (tokens, seconds) samples (linear if < 3)."""
    import numpy as np

    pts = [(n, t) for n, t in samples if n > 0 and t >= 0]
    if not pts:
        return (0.0, 1.0 / 600.0, 0.0)  # ~600 prefill tokens/s on 2 CPU cores
    x = np.array([p[0] for p in pts], dtype=float)
    y = np.array([p[1] for p in pts], dtype=float)
    if len(pts) >= 3:
        c, b, a = np.polyfit(x, y, 2)
    elif len(pts) == 2:
        (b, a), c = np.polyfit(x, y, 1), 0.0
    else:
        a, b, c = 0.0, y[0] / x[0], 0.0
    return float(a), float(b), float(c)


def prefill_time(coeffs: tuple[float, float, float], num_tokens: int) -> float:
    a, b, c = coeffs
    return max(a + b * num_tokens + c * num_tokens * num_tokens, 0.0)
