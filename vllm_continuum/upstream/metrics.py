"""The pin metrics at ``/metrics``: a stat logger plugin (entry point group
``vllm.stat_logger_plugins``, loaded by upstream's front end next to its own loggers).

The engine process puts its pin figures in ``SchedulerStats.num_kv_fetch_reqs_by_stage``
under ``continuum:`` keys (the one free-form field that crosses upstream's msgspec channel
intact: upstream's loggers read only their own stage names from it). Plugin loggers are
called before upstream's, so this one also takes the keys out again. Counters travel as
totals since start; the increments are computed here, so a lost stats message loses
nothing.

Metrics (labelled ``model_name`` and ``engine``, like upstream's): the pin series our
engine exports, declared once (``vllm_continuum.pins.PIN_METRICS``):
``vllm:num_pinned_requests``, ``vllm:pinned_kv_blocks`` (gauges), ``vllm:pins_total``,
``vllm:pin_hits_total``, ``vllm:pin_expiries_total``, ``vllm:pin_forced_releases_total``;
and the policy's own series (``Policy.metrics()``, e.g. ContextServe's
``vllm:context_serve_*``), as our engine exports them. Those travel under
``continuum-policy:`` keys (``PolicyStatTotals``): a counter as its total since start, a
gauge as its last value, a histogram's observations one key each, numbered, each carried by
the next ``OBSERVATION_REPORTS`` reports (the logger observes a number once). Values travel
in millionths (the dict holds ints).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from vllm.v1.metrics.loggers import StatLoggerBase
from vllm_continuum.metrics import MetricSpec, merge_specs
from vllm_continuum.pins import PIN_METRICS
from vllm_continuum.policy.registry import policy_metrics
from vllm_continuum.upstream.pins import STATS_PREFIX

_LABELS = ["model_name", "engine"]
_METRICS: dict[str, Any] = {}  # one registration per process, whatever the logger count


POLICY_PREFIX = "continuum-policy:"
SCALE = 1_000_000  # values travel in millionths
OBSERVATION_REPORTS = 4  # stats reports that carry each histogram observation


def _metric(spec: MetricSpec) -> Any:
    if spec.name not in _METRICS:
        labels = [*_LABELS, *spec.labels]
        if spec.kind == "gauge":
            _METRICS[spec.name] = Gauge(
                spec.name, spec.documentation, labels, multiprocess_mode="mostrecent"
            )
        elif spec.kind == "histogram":
            _METRICS[spec.name] = Histogram(
                spec.name, spec.documentation, labels, buckets=spec.buckets
            )
        else:
            _METRICS[spec.name] = Counter(spec.name, spec.documentation, labels)
    return _METRICS[spec.name]


class PolicyStatTotals:
    """Engine side: a policy's reports (``Policy.make_stats``, read by its ``metrics()``
    specs) kept as totals, last values and numbered observations, and written into
    upstream's stats dict under ``POLICY_PREFIX`` (module docstring)."""

    def __init__(self, specs: tuple[MetricSpec, ...]) -> None:
        self.specs = specs
        self.values: dict[tuple[str, tuple[str, ...]], float] = {}
        self.observations: list[list] = []  # [name, labels, number, value, reports left]
        self._number = 0

    def add(self, stats: Any) -> None:
        """One report of the policy's (None: nothing)."""
        if stats is None:
            return
        for spec in self.specs:
            for labels, value in spec.samples(stats):
                key = (spec.name, labels)
                if spec.kind == "counter":
                    self.values[key] = self.values.get(key, 0.0) + value
                elif spec.kind == "gauge":
                    self.values[key] = value
                else:
                    self._number += 1
                    self.observations.append(
                        [spec.name, labels, self._number, value, OBSERVATION_REPORTS]
                    )

    def write(self, by_stage: dict[str, int]) -> None:
        """The figures into ``by_stage`` (``SchedulerStats.num_kv_fetch_reqs_by_stage``);
        each observation counts one report more."""
        for (name, labels), value in self.values.items():
            by_stage[POLICY_PREFIX + json.dumps([name, list(labels)])] = round(value * SCALE)
        for item in self.observations:
            name, labels, number, value, _ = item
            key = POLICY_PREFIX + json.dumps([name, list(labels), number])
            by_stage[key] = round(value * SCALE)
            item[4] -= 1
        self.observations = [item for item in self.observations if item[4] > 0]


# (series name, label values, observation number or None, value)
PolicyFigure = tuple[str, tuple[str, ...], int | None, float]


def take_policy_stats(by_stage: dict[str, int]) -> list[PolicyFigure]:
    """Remove and return the policy's figures from the stats dict."""
    out = []
    for key in [k for k in by_stage if k.startswith(POLICY_PREFIX)]:
        value = by_stage.pop(key) / SCALE
        name, labels, *number = json.loads(key[len(POLICY_PREFIX) :])
        out.append((name, tuple(labels), number[0] if number else None, value))
    return out


def take_pin_stats(by_stage: dict[str, int]) -> dict[str, int]:
    """Remove and return the pin figures (without prefix) from the stats dict."""
    keys = [k for k in by_stage if k.startswith(STATS_PREFIX)]
    return {k[len(STATS_PREFIX) :]: by_stage.pop(k) for k in keys}


class PinStatLogger(StatLoggerBase):
    """``PIN_METRICS`` (the series our engine exports too) fed from the pin figures, and
    the policy's own series from its figures. As in our engine's front end, every
    registered policy's series are known (the front end does not know which one the
    engine runs); those of the running policy appear with its first report."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.model_name = vllm_config.model_config.served_model_name
        self.engine = str(engine_index)
        self._totals: dict[str, float] = {}
        self._policy_specs = {s.name: s for s in merge_specs(policy_metrics().values())}
        self._policy_totals: dict[tuple, float] = {}
        self._last_observation: dict[tuple, int] = {}

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        by_stage = scheduler_stats.num_kv_fetch_reqs_by_stage
        figures = take_pin_stats(by_stage)
        self._record_policy(take_policy_stats(by_stage), (self.model_name, str(engine_idx)))
        if not figures:
            return
        labels = (self.model_name, str(engine_idx))
        view = SimpleNamespace(**figures)
        for spec in PIN_METRICS:
            series = _metric(spec).labels(*labels)  # shown from the first report, at 0
            for _, value in spec.samples(view):
                if spec.kind == "gauge":
                    series.set(value)
                    continue
                delta = value - self._totals.get(spec.name, 0)  # totals since start
                if delta > 0:
                    series.inc(delta)
                self._totals[spec.name] = value

    def _record_policy(self, figures: list[PolicyFigure], engine_labels: tuple[str, str]) -> None:
        """A counter grows by its total's increase, a gauge takes its value, a histogram
        observes each number it has not seen."""
        for name, labels, number, value in sorted(figures, key=lambda f: f[2] or 0):
            spec = self._policy_specs.get(name)
            if spec is None:  # a policy unknown here (registered in the engine only)
                continue
            series = _metric(spec).labels(*engine_labels, *labels)
            key = (engine_labels, name, labels)
            if spec.kind == "gauge":
                series.set(value)
            elif spec.kind == "counter":
                delta = value - self._policy_totals.get(key, 0.0)
                if delta > 0:
                    series.inc(delta)
                self._policy_totals[key] = value
            elif number > self._last_observation.get(key, 0):
                series.observe(value)
                self._last_observation[key] = number

    def log_engine_initialized(self) -> None:
        pass
