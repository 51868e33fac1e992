"""ContextServe's counters since the previous report (deltas), for metrics exporters.

Engine-agnostic and light (no numpy): the engine's ``SchedulerStats`` carries one of
these per step, and its Prometheus logger turns it into ``vllm:context_serve_*`` series.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

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
