"""The pin metrics at ``/metrics``: a stat logger plugin (entry point group
``vllm.stat_logger_plugins``, loaded by upstream's front end next to its own loggers).

The engine process puts its pin figures in ``SchedulerStats.num_kv_fetch_reqs_by_stage``
under ``continuum:`` keys (the one free-form field that crosses upstream's msgspec channel
intact: upstream's loggers read only their own stage names from it). Plugin loggers are
called before upstream's, so this one also takes the keys out again. Counters travel as
totals since start; the increments are computed here, so a lost stats message loses
nothing.

Metrics (labelled ``model_name`` and ``engine``, like upstream's):
``vllm:num_pinned_requests``, ``vllm:pinned_kv_blocks`` (gauges), ``vllm:pins_total``,
``vllm:pin_hits_total``, ``vllm:pin_expiries_total``, ``vllm:pin_forced_releases_total``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge
from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_continuum.upstream.pins import COUNTERS, GAUGES, STATS_PREFIX

_HELP = {
    "num_pinned_requests": "Finished requests whose KV blocks are pinned for their job.",
    "pinned_kv_blocks": "KV blocks held by pins.",
    "pins": "Pins placed.",
    "pin_hits": "Pins ended by the job's next turn taking its prefix hit.",
    "pin_expiries": "Pins ended by their TTL.",
    "pin_forced_releases": "Pins released because memory was needed.",
}
_METRICS: dict[str, Any] = {}  # one registration per process, whatever the logger count


def _metric(name: str) -> Any:
    if name not in _METRICS:
        labels = ["model_name", "engine"]
        if name in GAUGES:
            _METRICS[name] = Gauge(
                f"vllm:{name}", _HELP[name], labels, multiprocess_mode="mostrecent"
            )
        else:
            _METRICS[name] = Counter(f"vllm:{name}", _HELP[name], labels)
    return _METRICS[name]


def take_pin_stats(by_stage: dict[str, int]) -> dict[str, int]:
    """Remove and return the pin figures (without prefix) from the stats dict."""
    keys = [k for k in by_stage if k.startswith(STATS_PREFIX)]
    return {k[len(STATS_PREFIX) :]: by_stage.pop(k) for k in keys}


class PinStatLogger(StatLoggerBase):
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.model_name = vllm_config.model_config.served_model_name
        self.engine = str(engine_index)
        self._totals: dict[str, int] = {}

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
        for name in GAUGES:
            _metric(name).labels(*labels).set(figures.get(name, 0))
        for name in COUNTERS:
            total = figures.get(name, 0)
            delta = total - self._totals.get(name, 0)
            if delta > 0:
                _metric(name).labels(*labels).inc(delta)
            self._totals[name] = total

    def log_engine_initialized(self) -> None:
        pass
