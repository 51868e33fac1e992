"""ContextServe's counters since the previous report (deltas), for metrics exporters.

Engine-agnostic and light (no numpy): the engine's ``SchedulerStats`` carries one of
these per step, and its exporter turns it into the ``vllm:context_serve_*`` series that
``CONTEXT_SERVE_METRICS`` declares.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm_continuum.metrics import MetricSpec, Sample, by_label, each_of

# Regret kinds: a SLOW verdict whose tool returned within the fast threshold (the context
# could have been pinned), and a FAST verdict whose tool outlived its pin.
REGRET_SLOW_WAS_FAST = "slow_was_fast"
REGRET_FAST_WAS_SLOW = "fast_was_slow"


@dataclass
class ContextServeStats:
    """Deltas since the previous report."""

    # (speed class, layer) -> number of verdicts, e.g. ("slow", "bayes") -> 3.
    decisions: Counter = field(default_factory=Counter)
    # |observed - predicted| tool time, seconds, for verdicts that predicted a time.
    prediction_errors_s: list[float] = field(default_factory=list)
    # How FAST (strict) pins ended: "hit", "expired", "pressure", "shutdown", ...
    fast_pin_outcomes: Counter = field(default_factory=Counter)
    # REGRET_* -> count.
    regret: Counter = field(default_factory=Counter)
    # Background XGBoost trainings finished / failed.
    trainings: int = 0
    training_failures: int = 0


def _trainings(stats: ContextServeStats) -> list[Sample]:
    counts = (("ok", stats.trainings), ("failed", stats.training_failures))
    return [((result,), n) for result, n in counts if n]


_TOOL_ERROR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# ContextServe's series, read from a ``ContextServeStats`` (see ``vllm_continuum.metrics``).
CONTEXT_SERVE_METRICS = (
    MetricSpec(
        "vllm:context_serve_decisions",
        "counter",
        "ContextServe verdicts on finished turns, by speed class and deciding layer.",
        labels=("speed", "layer"),
        read=by_label("decisions"),
    ),
    MetricSpec(
        "vllm:context_serve_prediction_error_seconds",
        "histogram",
        "|observed - predicted| tool time of verdicts that predicted one.",
        buckets=_TOOL_ERROR_BUCKETS,
        read=each_of("prediction_errors_s"),
    ),
    MetricSpec(
        "vllm:context_serve_fast_pins",
        "counter",
        "How FAST (strict) pins ended.",
        labels=("outcome",),
        read=by_label("fast_pin_outcomes"),
    ),
    MetricSpec(
        "vllm:context_serve_regret",
        "counter",
        "Verdicts the measured tool time proved wrong (slow_was_fast, fast_was_slow).",
        labels=("kind",),
        read=by_label("regret"),
    ),
    MetricSpec(
        "vllm:context_serve_trainings",
        "counter",
        "Background XGBoost trainings.",
        labels=("result",),
        read=_trainings,
    ),
)
