"""The vocabulary of ContextServe's predictor: a tool call's speed class and the layer
that decided it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ToolSpeed(enum.StrEnum):
    """FAST: pin the context for the predicted tool time; SLOW: free (or offload) it at
    once; UNCERTAIN: Continuum's TTL rule decides."""

    FAST = "fast"
    SLOW = "slow"
    UNCERTAIN = "uncertain"


class Layer(enum.StrEnum):
    """Which predictor layer decided (cheapest first)."""

    RULES = "rules"
    BAYES = "bayes"
    XGBOOST = "xgboost"
    FALLBACK = "fallback"  # no layer was confident, or no tool call was found


@dataclass(frozen=True)
class Prediction:
    """A layer's verdict on one tool call.

    ``p_fast`` (``p_slow``): the layer's probability that the tool returns within the
    fast threshold (runs past the slow threshold); None for the rule table, which is
    certain by construction. ``ttl_s``: the pin length
    a FAST verdict asks for (None otherwise). ``predicted_s``: the layer's point estimate
    of the tool time, when it has one (the Bayesian posterior median).
    """

    speed: ToolSpeed
    layer: Layer
    p_fast: float | None = None
    ttl_s: float | None = None
    predicted_s: float | None = None
    p_slow: float | None = None

    def describe(self) -> str:
        """ "bayes, p=0.97" for logs: the layer and its confidence in the verdict."""
        if self.p_fast is None:
            return self.layer.value
        p = self.p_fast
        if self.speed == ToolSpeed.SLOW:
            p = self.p_slow if self.p_slow is not None else 1.0 - self.p_fast
        return f"{self.layer.value}, p={p:.2f}"


UNCERTAIN = Prediction(ToolSpeed.UNCERTAIN, Layer.FALLBACK)
