"""Layer 3: an XGBoost classifier over command features, trained in the background.

``train_model`` is pure (commands and durations in, a model out). ``XGBoostLayer`` keeps
the most recent observations, starts a daemon thread to retrain every ``retrain_every``
new ones (never in the caller's thread: the scheduler only appends to a deque), and
swaps the trained model in with one reference assignment, which is atomic in Python.
A failing training is logged and counted; the previous model stays.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.features import FEATURE_NAMES, command_features, feature_matrix
from vllm_continuum.context_serve.types import Layer, Prediction, ToolSpeed

logger = logging.getLogger(__name__)

_CACHE_SIZE = 4096


# The classes a model predicts: the tool returns within the fast threshold, between the
# thresholds, or past the slow threshold.
FAST_CLASS, MIDDLE_CLASS, SLOW_CLASS = 0, 1, 2
NUM_CLASSES = 3


class XGBoostModel:
    """A trained booster: per command, P(fast), P(in between), P(slow)."""

    def __init__(self, booster) -> None:
        self.booster = booster
        self._cache: dict[str, tuple[float, float]] = {}

    @classmethod
    def load(cls, path: str) -> XGBoostModel:
        """A model saved by ``save`` (or the training script); ValueError if unusable."""
        import xgboost as xgb

        try:
            booster = xgb.Booster()
            booster.load_model(path)
        except (OSError, xgb.core.XGBoostError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"context_serve model: cannot load {path!r}: {first}") from None
        if _num_classes(booster) != NUM_CLASSES:
            raise ValueError(
                f"context_serve model: {path!r} is not a {NUM_CLASSES}-class model "
                "(train it with our_experiments/scripts/train_context_serve.py)"
            )
        if list(booster.feature_names or ()) != list(FEATURE_NAMES):
            raise ValueError(
                f"context_serve model: {path!r} was trained on other features "
                f"({len(booster.feature_names or ())} columns, expected {len(FEATURE_NAMES)})"
            )
        return cls(booster)

    def save(self, path: str) -> None:
        self.booster.save_model(path)

    def probabilities(self, command: str) -> tuple[float, float]:
        """(P(fast), P(slow)) of one command."""
        p = self._cache.get(command)
        if p is None:
            row = np.array([command_features(command)], dtype=np.float32)
            probs = self.booster.inplace_predict(row)[0]
            p = (float(probs[FAST_CLASS]), float(probs[SLOW_CLASS]))
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[command] = p
        return p

    def predicted_class(self, command: str) -> int:
        """The most likely class of one command (FAST_CLASS, MIDDLE_CLASS or SLOW_CLASS)."""
        p_fast, p_slow = self.probabilities(command)
        p_middle = 1.0 - p_fast - p_slow
        return max((p_fast, FAST_CLASS), (p_middle, MIDDLE_CLASS), (p_slow, SLOW_CLASS))[1]


def _num_classes(booster) -> int:
    """The classes of a booster's softprob objective (0 for any other objective)."""
    import json

    try:
        learner = json.loads(booster.save_config())["learner"]
        if learner["objective"]["name"] != "multi:softprob":
            return 0
        return int(learner["learner_model_param"]["num_class"])
    except (KeyError, ValueError):
        return 0


def duration_class(seconds: float, config: ContextServeConfig) -> int:
    if seconds <= config.fast_threshold_s:
        return FAST_CLASS
    return SLOW_CLASS if seconds > config.slow_threshold_s else MIDDLE_CLASS


def train_model(
    commands: Sequence[str], durations: Sequence[float], config: ContextServeConfig
) -> XGBoostModel | None:
    """Fit the duration classes; None unless at least two classes are present."""
    import xgboost as xgb

    labels = np.array([duration_class(d, config) for d in durations], dtype=np.float32)
    if len(labels) == 0 or labels.min() == labels.max():
        return None
    data = xgb.DMatrix(
        feature_matrix(list(commands)), label=labels, feature_names=list(FEATURE_NAMES)
    )
    params = {
        "objective": "multi:softprob",
        "num_class": NUM_CLASSES,
        "max_depth": config.xgb_max_depth,
        "eta": 0.3,
        "nthread": 1,  # the engine's cores belong to the model
        "seed": config.seed,
        "verbosity": 0,
    }
    return XGBoostModel(xgb.train(params, data, num_boost_round=config.xgb_rounds))


Trainer = Callable[[Sequence[str], Sequence[float], ContextServeConfig], "XGBoostModel | None"]


class XGBoostLayer:
    """Holds the current model; learns from (command, duration) in a background thread."""

    def __init__(
        self,
        config: ContextServeConfig,
        model: XGBoostModel | None = None,
        trainer: Trainer = train_model,
    ) -> None:
        self.config = config
        self.model = model
        self.trainer = trainer
        self.data: deque[tuple[str, float]] = deque(maxlen=config.max_train_samples)
        self.trainings = 0
        self.failures = 0
        self._since_training = 0
        self._thread: threading.Thread | None = None

    def observe(self, command: str, seconds: float) -> None:
        """Keep one observation; start a background training when enough are new."""
        self.data.append((command, seconds))
        self._since_training += 1
        if not self.config.online_training or len(self.data) < self.config.min_train_samples:
            return
        if self._since_training >= self.config.retrain_every and not self.training:
            self._since_training = 0
            commands, durations = zip(*self.data, strict=True)
            self._thread = threading.Thread(
                target=self._train,
                args=(commands, durations),
                name="context-serve-xgb",
                daemon=True,
            )
            self._thread.start()

    @property
    def training(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Join the running training, if any (tests and shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _train(self, commands: Sequence[str], durations: Sequence[float]) -> None:
        try:
            model = self.trainer(commands, durations, self.config)
        except Exception:
            self.failures += 1
            logger.exception("context_serve: background XGBoost training failed")
            return
        if model is not None:
            self.model = model  # one assignment: readers see the old or the new model
            self.trainings += 1

    def predict(self, command: str | None) -> Prediction | None:
        """FAST / SLOW / UNCERTAIN from the model; None without a model or a command."""
        model = self.model
        if model is None or not command:
            return None
        p_fast, p_slow = model.probabilities(command)
        cfg = self.config
        if p_fast >= cfg.fast_confidence:
            return Prediction(ToolSpeed.FAST, Layer.XGBOOST, p_fast, cfg.fast_pin_s, p_slow=p_slow)
        speed = ToolSpeed.SLOW if p_slow >= cfg.slow_confidence else ToolSpeed.UNCERTAIN
        return Prediction(speed, Layer.XGBOOST, p_fast, p_slow=p_slow)
