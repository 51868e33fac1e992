"""Layer 2: per tool, a Normal-Inverse-Gamma posterior over the log of its duration.

With log durations x ~ N(mu, sigma^2) and the conjugate prior
mu | sigma^2 ~ N(mu0, sigma^2 / kappa0), sigma^2 ~ InvGamma(alpha0, beta0), one
observation x updates the posterior in closed form:

    kappa' = kappa + 1                 mu'   = (kappa * mu + x) / (kappa + 1)
    alpha' = alpha + 1/2               beta' = beta + kappa * (x - mu)^2 / (2 * (kappa + 1))

and the next duration's log is Student-t with 2*alpha degrees of freedom, location mu
and scale^2 = beta * (kappa + 1) / (alpha * kappa). The class comes from Thompson
sampling: draw (mu, sigma^2) from the posterior, and call the tool FAST if, under the
draw, it returns within the fast threshold with probability >= the FAST confidence, and
SLOW if it runs past the slow threshold with probability >= the SLOW confidence. The FAST
pin is a quantile of the predictive distribution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import stdtr, stdtrit

from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.types import Layer, Prediction, ToolSpeed

MIN_SECONDS = 1e-3  # durations are clamped here before the log (a 0 s tool is 1 ms)
MAX_TOOLS = 10_000  # posteriors kept; odd outputs must not grow memory without bound


def log_seconds(seconds: float) -> float:
    return math.log(max(seconds, MIN_SECONDS))


@dataclass
class NIGPosterior:
    """Normal-Inverse-Gamma posterior over (mu, sigma^2) of log durations."""

    mu: float
    kappa: float
    alpha: float
    beta: float
    n: int = 0

    def update(self, x: float) -> None:
        """Condition on one log duration ``x`` (the conjugate update)."""
        kappa = self.kappa + 1.0
        self.beta += self.kappa * (x - self.mu) ** 2 / (2.0 * kappa)
        self.mu = (self.kappa * self.mu + x) / kappa
        self.kappa = kappa
        self.alpha += 0.5
        self.n += 1

    def predictive(self) -> tuple[float, float, float]:
        """(degrees of freedom, location, scale) of the next log duration (Student-t)."""
        scale = math.sqrt(self.beta * (self.kappa + 1.0) / (self.alpha * self.kappa))
        return 2.0 * self.alpha, self.mu, scale

    def predictive_cdf(self, x: float) -> float:
        df, loc, scale = self.predictive()
        return float(stdtr(df, (x - loc) / scale))

    def predictive_quantile(self, q: float) -> float:
        df, loc, scale = self.predictive()
        return loc + scale * float(stdtrit(df, q))

    def sample(self, rng: np.random.Generator) -> tuple[float, float]:
        """One draw of (mu, sigma^2) from the posterior."""
        sigma2 = self.beta / rng.gamma(self.alpha)
        return float(rng.normal(self.mu, math.sqrt(sigma2 / self.kappa))), float(sigma2)


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


class BayesianLayer:
    """One posterior per tool name; decides once a tool has ``min_observations``."""

    def __init__(self, config: ContextServeConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng
        self.posteriors: dict[str, NIGPosterior] = {}
        self._log_fast = math.log(config.fast_threshold_s)
        self._log_slow = math.log(config.slow_threshold_s)

    def prior(self) -> NIGPosterior:
        c = self.config
        return NIGPosterior(c.prior_mean_log_s, c.prior_kappa, c.prior_alpha, c.prior_beta)

    def observe(self, tool: str, seconds: float) -> None:
        """Learn one measured duration of ``tool`` (seconds, >= 0)."""
        posterior = self.posteriors.get(tool)
        if posterior is None:
            if len(self.posteriors) >= MAX_TOOLS:
                return
            posterior = self.posteriors[tool] = self.prior()
        posterior.update(log_seconds(seconds))

    def predict(self, tool: str | None) -> Prediction | None:
        """The Thompson-sampled class of ``tool``; None while it has too few durations."""
        posterior = self.posteriors.get(tool) if tool else None
        if posterior is None or posterior.n < self.config.min_observations:
            return None
        mu, sigma2 = posterior.sample(self.rng)
        sigma = math.sqrt(sigma2)
        sampled_p_fast = _normal_cdf((self._log_fast - mu) / sigma)
        sampled_p_slow = 1.0 - _normal_cdf((self._log_slow - mu) / sigma)
        p_fast = posterior.predictive_cdf(self._log_fast)
        p_slow = 1.0 - posterior.predictive_cdf(self._log_slow)
        median = math.exp(posterior.mu)
        if sampled_p_fast >= self.config.fast_confidence:
            ttl = math.exp(posterior.predictive_quantile(self.config.ttl_quantile))
            return Prediction(ToolSpeed.FAST, Layer.BAYES, p_fast, ttl, median, p_slow)
        speed = ToolSpeed.SLOW if sampled_p_slow >= self.config.slow_confidence else None
        return Prediction(speed or ToolSpeed.UNCERTAIN, Layer.BAYES, p_fast, None, median, p_slow)
