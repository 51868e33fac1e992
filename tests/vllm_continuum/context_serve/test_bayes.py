"""Layer 2: the Normal-Inverse-Gamma posterior and Thompson sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from vllm_continuum.context_serve.bayes import BayesianLayer, NIGPosterior, log_seconds
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.types import Layer, ToolSpeed


def closed_form(mu0, kappa0, alpha0, beta0, xs):
    """The batch posterior of the conjugate model (Murphy 2007, eq. 85-89)."""
    n, mean = len(xs), float(np.mean(xs))
    kappa = kappa0 + n
    mu = (kappa0 * mu0 + n * mean) / kappa
    alpha = alpha0 + n / 2
    beta = beta0 + 0.5 * float(np.sum((np.array(xs) - mean) ** 2))
    beta += kappa0 * n * (mean - mu0) ** 2 / (2 * kappa)
    return mu, kappa, alpha, beta


def test_sequential_updates_equal_the_closed_form():
    xs = [math.log(s) for s in (0.2, 0.5, 0.3, 4.0, 0.25, 0.4)]
    post = NIGPosterior(0.0, 1.0, 2.0, 1.0)
    for x in xs:
        post.update(x)
    mu, kappa, alpha, beta = closed_form(0.0, 1.0, 2.0, 1.0, xs)
    assert post.n == 6
    assert (post.mu, post.kappa, post.alpha) == pytest.approx((mu, kappa, alpha))
    assert post.beta == pytest.approx(beta)


def test_predictive_is_the_student_t():
    post = NIGPosterior(0.5, 2.0, 3.0, 1.5)
    df, loc, scale = post.predictive()
    assert df == 6.0 and loc == 0.5
    assert scale == pytest.approx(math.sqrt(1.5 * 3.0 / (3.0 * 2.0)))
    t = stats.t(df, loc, scale)
    assert post.predictive_cdf(1.0) == pytest.approx(t.cdf(1.0))
    assert post.predictive_quantile(0.9) == pytest.approx(t.ppf(0.9))


def test_posterior_sampling_matches_its_moments():
    post = NIGPosterior(1.0, 4.0, 5.0, 2.0)
    rng = np.random.default_rng(0)
    draws = np.array([post.sample(rng) for _ in range(20_000)])
    assert draws[:, 0].mean() == pytest.approx(1.0, abs=0.02)
    assert draws[:, 1].mean() == pytest.approx(2.0 / (5.0 - 1.0), rel=0.05)  # E[InvGamma]


def layer(seed=0, **cfg) -> BayesianLayer:
    return BayesianLayer(ContextServeConfig(**cfg), np.random.default_rng(seed))


def test_needs_min_observations_then_decides():
    b = layer(min_observations=5)
    for _ in range(4):
        b.observe("ls", 0.05)
    assert b.predict("ls") is None and b.predict("unknown") is None and b.predict(None) is None
    b.observe("ls", 0.06)
    p = b.predict("ls")
    assert p.speed == ToolSpeed.FAST and p.layer == Layer.BAYES and p.p_fast > 0.9
    # The FAST pin: the 0.9 predictive quantile of the duration, above the median.
    assert p.predicted_s < p.ttl_s < 2.0
    for _ in range(10):
        b.observe("pytest", 45.0)
    slow = b.predict("pytest")
    assert slow.speed == ToolSpeed.SLOW and slow.ttl_s is None and slow.p_fast < 0.05
    assert slow.p_slow > 0.8 and slow.describe() == f"bayes, p={slow.p_slow:.2f}"
    assert slow.predicted_s == pytest.approx(math.exp(b.posteriors["pytest"].mu))


def test_a_tool_between_the_thresholds_stays_uncertain():
    """A 3-5 s tool is neither fast (2 s) nor slow (10 s): Continuum's TTL decides it."""
    b = layer(min_observations=5)
    for i in range(40):
        b.observe("pytest <target>", 3.0 + (i % 5) * 0.5)
    verdicts = {b.predict("pytest <target>").speed for _ in range(100)}
    assert verdicts == {ToolSpeed.UNCERTAIN}
    p = b.predict("pytest <target>")
    assert p.p_fast < 0.2 and p.p_slow < 0.2


def test_slow_threshold_below_the_fast_one_is_refused():
    with pytest.raises(ValueError, match="slow_threshold_s"):
        ContextServeConfig(fast_threshold_s=5.0, slow_threshold_s=4.0)


def test_thompson_sampling_is_seeded_and_explores_near_the_threshold():
    def verdicts(seed):
        b = layer(seed, min_observations=3)
        for s in (1.0, 4.0, 1.5, 3.0, 2.0, 2.5):  # straddles the 2 s threshold
            b.observe("python", s)
        return [b.predict("python").speed for _ in range(200)]

    first = verdicts(7)
    assert first == verdicts(7)  # same seed, same draws
    assert first != verdicts(8)
    assert ToolSpeed.UNCERTAIN in first and len(set(first)) > 1  # unsure, and explores
    assert log_seconds(0.0) == math.log(1e-3)
