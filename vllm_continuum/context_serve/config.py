"""ContextServe's knobs: one frozen, validated dataclass (every field becomes a CLI flag)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from vllm_continuum.config import bad_value as _bad
from vllm_continuum.config import config_field


def _flag(name: str) -> str:
    return f"--context-serve-{name}"


@dataclass(frozen=True)
class ContextServeConfig:
    """Thresholds of the three-way dispatch and of its predictor layers (the flags are
    ``--context-serve-*``).

    A tool call is FAST when its tool returns within ``fast_threshold_s`` and SLOW when it
    runs longer than ``slow_threshold_s``; a layer calls it FAST (or SLOW) only when its
    probability of being fast (or slow) reaches ``fast_confidence`` (``slow_confidence``);
    otherwise the turn is UNCERTAIN and gets Continuum's TTL rule.
    """

    fast_threshold_s: float = config_field(
        2.0, "A tool that returns within this many seconds is fast.", flag=_flag("fast-threshold")
    )
    slow_threshold_s: float = config_field(
        10.0,
        "A tool that runs longer than this many seconds is slow (default: Continuum's "
        "default --continuum-max-ttl, beyond which a pin would expire before the tool "
        "returns); between the two thresholds a turn is UNCERTAIN.",
        flag=_flag("slow-threshold"),
    )
    fast_pin_s: float = config_field(
        3.0,
        "Pin length (seconds) of FAST verdicts by the rule table and XGBoost, capped by "
        "--continuum-max-ttl; the Bayesian layer pins for its posterior quantile instead.",
        flag=_flag("fast-pin"),
    )
    fast_confidence: float = config_field(
        0.8, "P(fast) a layer needs to call a turn FAST.", flag=_flag("fast-confidence")
    )
    slow_confidence: float = config_field(
        0.8, "P(slow) a layer needs to call a turn SLOW.", flag=_flag("slow-confidence")
    )
    min_observations: int = config_field(
        5,
        "Measured durations of a tool before the Bayesian layer decides for it.",
        flag=_flag("min-observations"),
    )
    ttl_quantile: float = config_field(
        0.9,
        "Posterior-predictive quantile of the tool time used as the Bayesian FAST pin.",
        flag=_flag("ttl-quantile"),
    )
    prior_mean_log_s: float = config_field(
        0.0, "Normal-Inverse-Gamma prior: mean of log seconds.", flag=_flag("prior-mean-log")
    )
    prior_kappa: float = config_field(
        1.0, "Normal-Inverse-Gamma prior: pseudo-count of the mean.", flag=_flag("prior-kappa")
    )
    prior_alpha: float = config_field(
        2.0, "Normal-Inverse-Gamma prior: shape of the variance.", flag=_flag("prior-alpha")
    )
    prior_beta: float = config_field(
        1.0, "Normal-Inverse-Gamma prior: scale of the variance.", flag=_flag("prior-beta")
    )
    rules: str | None = config_field(
        None,
        "JSON or YAML file extending the rule table: {fast: [...], slow_prefixes: [...]}.",
        flag=_flag("rules"),
    )
    model: str | None = config_field(
        None,
        "XGBoost model trained offline (our_experiments/scripts/train_context_serve.py).",
        flag=_flag("model"),
    )
    online_training: bool = config_field(
        True,
        "Train the XGBoost layer in a background thread from the measured tool times.",
        flag=_flag("online-training"),
    )
    retrain_every: int = config_field(
        50, "New measurements between two background trainings.", flag=_flag("retrain-every")
    )
    min_train_samples: int = config_field(
        40,
        "Measurements (fast and slow ones) needed before the first training.",
        flag=_flag("min-train-samples"),
    )
    max_train_samples: int = config_field(
        5000, "Most recent measurements kept for training.", flag=_flag("max-train-samples")
    )
    xgb_rounds: int = config_field(
        40, "Boosting rounds of the XGBoost classifier.", flag=_flag("xgb-rounds")
    )
    xgb_max_depth: int = config_field(
        4, "Tree depth of the XGBoost classifier.", flag=_flag("xgb-max-depth")
    )
    seed: int = config_field(0, "Seed of Thompson sampling and training.", flag=_flag("seed"))
    offload_slow: bool = config_field(
        True,
        "SLOW turns go to the CPU KV tier when one is configured (--kv-offloading-size); "
        "without a tier, or with --no-context-serve-offload-slow, they are freed.",
        flag=_flag("offload-slow"),
    )

    def __post_init__(self) -> None:
        for name in (
            "fast_threshold_s",
            "slow_threshold_s",
            "fast_pin_s",
            "prior_kappa",
            "prior_alpha",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise _bad(name, value, "must be a finite number > 0")
        if self.slow_threshold_s < self.fast_threshold_s:
            raise _bad("slow_threshold_s", self.slow_threshold_s, "must be >= fast_threshold_s")
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
