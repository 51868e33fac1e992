"""The TTL rule on hand-computed examples."""

from __future__ import annotations

import pytest

from vllm_continuum.ttl import (
    empirical_cdf,
    eta_from_turns,
    fit_prefill_profile,
    optimal_ttl,
    prefill_time,
)


def test_empirical_cdf():
    s = [0.1, 0.2, 0.2, 1.0]
    assert empirical_cdf(s, 0.0) == 0.0
    assert empirical_cdf(s, 0.2) == 0.75  # ties counted
    assert empirical_cdf(s, 5.0) == 1.0


def test_optimal_ttl_hand_computed():
    # durations 0.1, 0.2, 3.0 with gain 1.0:
    #   tau=0.1: 1/3 - 0.1 = 0.233;  tau=0.2: 2/3 - 0.2 = 0.467;  tau=3.0: 1 - 3 = -2
    assert optimal_ttl([0.2, 3.0, 0.1], gain_s=1.0, max_ttl_s=10) == 0.2
    # With gain 10 the slow tool is worth waiting for: 1*10 - 3 = 7 > 2/3*10 - 0.2 = 6.47
    assert optimal_ttl([0.2, 3.0, 0.1], gain_s=10.0, max_ttl_s=10) == 3.0
    # ... unless the cap forbids it.
    assert optimal_ttl([0.2, 3.0, 0.1], gain_s=10.0, max_ttl_s=2.0) == 0.2
    # Nothing beats not pinning when the gain is tiny: 1/3*0.1 - 0.1 < 0.
    assert optimal_ttl([0.1, 0.2, 3.0], gain_s=0.1, max_ttl_s=10) == 0.0
    assert optimal_ttl([], gain_s=5.0, max_ttl_s=10) == 0.0


def test_eta():
    # One job of 4 turns: k and N-k are perfectly anti-correlated -> eta = 1.
    assert eta_from_turns([(k, 4 - k) for k in range(1, 5)]) == pytest.approx(1.0)
    # Jobs of very different lengths weaken the relation.
    pairs = [(k, 2 - k) for k in (1, 2)] + [(k, 10 - k) for k in range(1, 11)]
    assert 0.0 < eta_from_turns(pairs) < 1.0
    assert eta_from_turns([]) == 1.0  # default before data


def test_prefill_fit_is_quadratic_through_samples():
    samples = [(n, 0.01 + 0.001 * n + 1e-6 * n * n) for n in (16, 64, 256, 1024)]
    coeffs = fit_prefill_profile(samples)
    assert prefill_time(coeffs, 512) == pytest.approx(0.01 + 0.512 + 0.262144, rel=1e-6)
    assert prefill_time(fit_prefill_profile([]), 600) == pytest.approx(1.0)
