"""ContextServe's knobs: one frozen, validated dataclass (every field becomes a CLI flag)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


def _bad(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"{name} {why}, got {value!r}")


@dataclass(frozen=True)
class ContextServeConfig:
    """Thresholds of the three-way dispatch and of its predictor layers.

    A tool call is FAST when its tool returns within ``fast_threshold_s``; a layer calls
    it FAST (or SLOW) only when its probability of being fast (or slow) reaches
    ``fast_confidence`` (``slow_confidence``); in between the turn is UNCERTAIN and gets
    Continuum's TTL rule.
    """

    # A tool that returns within this many seconds is fast.
    fast_threshold_s: float = 2.0
    # Pin length of FAST decisions by the rule table and XGBoost (capped by max_ttl_s); the
    # Bayesian layer pins for its own posterior quantile instead.
    fast_pin_s: float = 3.0
    # P(fast) a layer needs to call a turn FAST.
    fast_confidence: float = 0.8
    # P(slow) a layer needs to call a turn SLOW.
    slow_confidence: float = 0.8
    # Durations of a tool the Bayesian layer needs before it decides for that tool.
    min_observations: int = 5
    # Posterior-predictive quantile of the tool's duration used as the FAST pin length.
    ttl_quantile: float = 0.9
    # Normal-Inverse-Gamma prior over log seconds: mean, pseudo-count of the mean, shape,
    # scale (a weak prior centred on one second).
    prior_mean_log_s: float = 0.0
    prior_kappa: float = 1.0
    prior_alpha: float = 2.0
    prior_beta: float = 1.0
    # A JSON or YAML file extending the rule table (keys "fast", "slow_prefixes").
    rules: str | None = None
    # An XGBoost model trained offline (our_experiments/scripts/train_context_serve.py).
    model: str | None = None
    # Train the XGBoost layer in the background from observed durations.
    online_training: bool = True
    # New observations between two background trainings.
    retrain_every: int = 50
    # Observations (with both classes present) needed before the first training.
    min_train_samples: int = 40
    # Most recent observations kept for training.
    max_train_samples: int = 5000
    # Boosting rounds and tree depth of the XGBoost classifier.
    xgb_rounds: int = 40
    xgb_max_depth: int = 4
    # Seed of Thompson sampling and of training.
    seed: int = 0
    # SLOW turns are offloaded to the CPU KV tier (needs one) instead of freed.
    offload_slow: bool = False

    def __post_init__(self) -> None:
        for name in ("fast_threshold_s", "fast_pin_s", "prior_kappa", "prior_alpha"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise _bad(name, value, "must be a finite number > 0")
        if not self.prior_beta > 0:
            raise _bad("prior_beta", self.prior_beta, "must be > 0")
        if not math.isfinite(self.prior_mean_log_s):
            raise _bad("prior_mean_log_s", self.prior_mean_log_s, "must be finite")
        for name in ("fast_confidence", "slow_confidence", "ttl_quantile"):
            value = getattr(self, name)
            if not 0.5 <= value < 1.0:
                raise _bad(name, value, "must be in [0.5, 1)")
        for name in (
            "min_observations",
            "retrain_every",
            "min_train_samples",
            "xgb_rounds",
            "xgb_max_depth",
        ):
            if getattr(self, name) < 1:
                raise _bad(name, getattr(self, name), "must be >= 1")
        if self.max_train_samples < self.min_train_samples:
            raise _bad("max_train_samples", self.max_train_samples, "must be >= min_train_samples")
        for name in ("rules", "model"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(name, value, "must be a non-empty path or None")
            if value is not None and not os.access(value, os.R_OK):
                # Checked here so a front end building this config fails at start-up
                # with one line; the content is checked when the policy loads it.
                raise _bad(name, value, "must name a readable file")
