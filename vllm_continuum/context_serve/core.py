"""ContextServe's decisions: Continuum plus a three-way dispatch per finished turn.

``ContextServeCore`` is a ``ContinuumCore`` (same estimator, job order, TTL rule,
recorder) whose finished-turn decision first asks the predictor for the tool call's
speed class: FAST -> a strict pin for the predicted tool time (capped by
``max_ttl_s``), SLOW -> free (or offload) at once, UNCERTAIN -> Continuum's TTL. When
the job's next turn arrives, the measured tool time teaches the predictor and scores
the verdict (prediction error, regret).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_continuum.clock import Clock
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.predictor import ContextAwarePredictor
from vllm_continuum.context_serve.stats import (
    REGRET_FAST_WAS_SLOW,
    REGRET_SLOW_WAS_FAST,
    ContextServeStats,
)
from vllm_continuum.context_serve.types import Prediction, ToolSpeed
from vllm_continuum.continuum import MIN_PIN_S, ContinuumCore
from vllm_continuum.turns import FinishedTurn

if TYPE_CHECKING:
    from vllm_continuum.config import PolicyConfig

logger = logging.getLogger(__name__)

MAX_PENDING_JOBS = 100_000
_COMMAND_CHARS = 500  # of a command kept in scheduler_timestamps.json


@dataclass(frozen=True)
class Dispatch:
    """What to do with a finished turn's blocks: pin for ``ttl_s`` (> 0; ``strict`` for
    FAST), offload, or free (``ttl_s == 0`` and not ``offload``)."""

    speed: ToolSpeed
    ttl_s: float = 0.0
    strict: bool = False
    offload: bool = False

    def describe(self) -> str:
        if self.ttl_s > 0:
            return f"{'strict ' if self.strict else ''}pin {self.ttl_s:.2f}s"
        return "offload" if self.offload else "free"


FREE_DISPATCH = Dispatch(ToolSpeed.UNCERTAIN)


@dataclass(frozen=True)
class _Pending:
    """A verdict waiting for the job's next arrival (which measures the tool time)."""

    departure: float
    tool: str
    command: str | None
    prediction: Prediction
    dispatch: Dispatch


class ContextServeCore(ContinuumCore):
    """The state and decisions of one ContextServe policy instance."""

    def __init__(
        self,
        config: PolicyConfig,
        clock: Clock,
        cs_config: ContextServeConfig | None = None,
        record_dir: str | None = None,
    ) -> None:
        """ValueError (naming the option) when the rules or model file is unusable;
        ``record_dir``: where the per-job event log goes (None: no log)."""
        super().__init__(config, clock, record_dir=record_dir)
        self.cs_config = cs_config or ContextServeConfig()
        self.predictor = ContextAwarePredictor(self.cs_config)
        self.stats = ContextServeStats()
        self._pending: dict[str, _Pending] = {}
        self._strict_pins: set[str] = set()  # request ids holding a FAST pin
        self._trainings_seen = (0, 0)

    # -- events ---------------------------------------------------------------------------
    def on_arrival(
        self, job: str, request_id: str, now: float, named: bool, prompt_tokens: int
    ) -> None:
        super().on_arrival(job, request_id, now, named, prompt_tokens)
        pending = self._pending.pop(job, None)
        if pending is not None:
            self._learn(pending, max(now - pending.departure, 0.0))

    def on_finished(self, turn: FinishedTurn) -> float:
        """Continuum's contract (the pin's TTL, 0: free); ``decide`` says more."""
        return self.decide(turn).ttl_s

    def decide(self, turn: FinishedTurn) -> Dispatch:
        """A turn finished: the fate of its blocks (``depart`` says when it ended the job)."""
        call, is_last_step = self.depart(turn)
        job, request_id, now, num_tokens = turn.job, turn.request_id, turn.now, turn.num_tokens
        tool, command = (call.name, call.command) if call else (None, None)
        if is_last_step or not turn.named:
            self._record(job, "departure", request=request_id, func_call=tool,
                         is_last_step=is_last_step)  # fmt: skip
            if is_last_step:
                self._pending.pop(job, None)
            return FREE_DISPATCH
        prediction = self.predictor.predict(tool, command)
        dispatch = self._dispatch(prediction, num_tokens, tool)
        if prediction.speed == ToolSpeed.SLOW:
            self.admission.expect_late(job, now)  # its memory serves others meanwhile
        self._account(job, request_id, now, tool, command, prediction, dispatch)
        return dispatch

    def on_pin_released(self, job: str, request_id: str, reason: str) -> None:
        super().on_pin_released(job, request_id, reason)
        if request_id in self._strict_pins:
            self._strict_pins.discard(request_id)
            self.stats.fast_pin_outcomes[reason] += 1

    def make_stats(self) -> ContextServeStats:
        """The counters since the previous call (and a fresh set for the next)."""
        stats, self.stats = self.stats, ContextServeStats()
        xgb = self.predictor.xgb
        seen, self._trainings_seen = self._trainings_seen, (xgb.trainings, xgb.failures)
        stats.trainings = xgb.trainings - seen[0]
        stats.training_failures = xgb.failures - seen[1]
        return stats

    def shutdown(self) -> None:
        super().shutdown()
        self.predictor.xgb.wait(timeout=1.0)

    # -- the dispatch ---------------------------------------------------------------------
    def _dispatch(self, prediction: Prediction, num_tokens: int, tool: str | None) -> Dispatch:
        if prediction.speed == ToolSpeed.FAST:
            ttl = min(prediction.ttl_s or self.cs_config.fast_pin_s, self.config.max_ttl_s)
            if ttl < MIN_PIN_S:
                return Dispatch(ToolSpeed.FAST)
            return Dispatch(ToolSpeed.FAST, ttl, strict=True)
        if prediction.speed == ToolSpeed.SLOW:
            return Dispatch(ToolSpeed.SLOW, offload=self.cs_config.offload_slow)
        ttl = self.ttl_for(num_tokens, tool)
        return Dispatch(ToolSpeed.UNCERTAIN, ttl if ttl >= MIN_PIN_S else 0.0)

    def _account(self, job, request_id, now, tool, command, prediction, dispatch) -> None:
        """Log, record and count one verdict; remember it until the tool time is known."""
        self.log(
            "job %r: func_call=%s -> %s (%s) %s",
            job,
            tool,
            prediction.speed.name,
            prediction.describe(),
            dispatch.describe(),
        )
        self._record(
            job,
            "departure",
            request=request_id,
            func_call=tool,
            command=command[:_COMMAND_CHARS] if command else None,
            is_last_step=False,
            speed=prediction.speed.value,
            layer=prediction.layer.value,
            p_fast=prediction.p_fast,
            predicted_s=prediction.predicted_s,
            ttl_s=dispatch.ttl_s,
        )
        self.stats.decisions[(prediction.speed.value, prediction.layer.value)] += 1
        if dispatch.ttl_s > 0:
            self._record(job, "pinned", request=request_id, ttl_s=dispatch.ttl_s,
                         strict=dispatch.strict)  # fmt: skip
            if dispatch.strict:
                self._strict_pins.add(request_id)
        if tool is not None:
            if len(self._pending) >= MAX_PENDING_JOBS:
                self._pending.pop(next(iter(self._pending)))
            self._pending[job] = _Pending(now, tool, command, prediction, dispatch)

    def _learn(self, pending: _Pending, seconds: float) -> None:
        self.predictor.observe(pending.tool, pending.command, seconds)
        prediction, dispatch = pending.prediction, pending.dispatch
        if prediction.predicted_s is not None:
            self.stats.prediction_errors_s.append(abs(seconds - prediction.predicted_s))
        fast = seconds <= self.cs_config.fast_threshold_s
        if prediction.speed == ToolSpeed.SLOW and fast:
            self.stats.regret[REGRET_SLOW_WAS_FAST] += 1
        elif dispatch.strict and seconds > dispatch.ttl_s:
            self.stats.regret[REGRET_FAST_WAS_SLOW] += 1
