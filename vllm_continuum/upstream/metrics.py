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
``vllm:pin_hits_total``, ``vllm:pin_expiries_total``, ``vllm:pin_forced_releases_total``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import Counter, Gauge

from vllm.v1.metrics.loggers import StatLoggerBase
from vllm_continuum.metrics import MetricSpec
from vllm_continuum.pins import PIN_METRICS
from vllm_continuum.upstream.pins import STATS_PREFIX

_LABELS = ["model_name", "engine"]
_METRICS: dict[str, Any] = {}  # one registration per process, whatever the logger count


def _metric(spec: MetricSpec) -> Any:
    if spec.name not in _METRICS:
        if spec.kind == "gauge":
            _METRICS[spec.name] = Gauge(
                spec.name, spec.documentation, _LABELS, multiprocess_mode="mostrecent"
            )
        else:
            _METRICS[spec.name] = Counter(spec.name, spec.documentation, _LABELS)
    return _METRICS[spec.name]


def take_pin_stats(by_stage: dict[str, int]) -> dict[str, int]:
    """Remove and return the pin figures (without prefix) from the stats dict."""
    keys = [k for k in by_stage if k.startswith(STATS_PREFIX)]
    return {k[len(STATS_PREFIX) :]: by_stage.pop(k) for k in keys}


class PinStatLogger(StatLoggerBase):
    """``PIN_METRICS`` (the series our engine exports too) fed from the pin figures."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.model_name = vllm_config.model_config.served_model_name
        self.engine = str(engine_index)
        self._totals: dict[str, float] = {}

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        figures = take_pin_stats(scheduler_stats.num_kv_fetch_reqs_by_stage)
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

    def log_engine_initialized(self) -> None:
        pass
