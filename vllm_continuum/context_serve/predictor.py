"""The stacked predictor: rules -> Bayesian per tool -> XGBoost -> UNCERTAIN.

Each layer answers only when it can: the rule table for commands it knows, the
Bayesian layer for tools with enough measured durations, XGBoost once a model exists.
``predict`` never raises on odd input (an unknown tool, no command): it says UNCERTAIN.
"""

from __future__ import annotations

import logging

import numpy as np

from vllm_continuum.context_serve.bayes import BayesianLayer
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.rules import RuleTable, learning_key
from vllm_continuum.context_serve.types import UNCERTAIN, Layer, Prediction, ToolSpeed
from vllm_continuum.context_serve.xgb import XGBoostLayer, XGBoostModel

logger = logging.getLogger(__name__)


class ContextAwarePredictor:
    """Predicts a tool call's speed class; learns from measured tool durations."""

    def __init__(self, config: ContextServeConfig) -> None:
        """Loads the rule and model files named by ``config``: ValueError if unusable."""
        self.config = config
        self.rules = RuleTable.from_file(config.rules) if config.rules else RuleTable.default()
        model = XGBoostModel.load(config.model) if config.model else None
        self.bayes = BayesianLayer(config, np.random.default_rng(config.seed))
        self.xgb = XGBoostLayer(config, model)

    def predict(self, tool: str | None, command: str | None) -> Prediction:
        """The verdict on one tool call (``tool``: normalised name; ``command``: its text)."""
        if not tool:
            return UNCERTAIN
        try:
            return self._predict(tool, command or tool)
        except Exception:  # a predictor bug must not take the engine down
            logger.exception("context_serve: prediction failed for %r", tool)
            return UNCERTAIN

    def _predict(self, tool: str, command: str) -> Prediction:
        verdict = self.rules.classify(tool, command)
        if verdict is not None:
            ttl = self.config.fast_pin_s if verdict == ToolSpeed.FAST else None
            return Prediction(verdict, Layer.RULES, ttl_s=ttl)
        key = learning_key(tool, command)
        return self.bayes.predict(key) or self.xgb.predict(command) or UNCERTAIN

    def observe(self, tool: str, command: str | None, seconds: float) -> None:
        """A measured duration of a tool call: every learning layer takes it."""
        self.bayes.observe(learning_key(tool, command or tool), seconds)
        self.xgb.observe(command or tool, seconds)
