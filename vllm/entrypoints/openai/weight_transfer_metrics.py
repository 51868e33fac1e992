"""vLLM's Prometheus series for the RL weight-transfer routes (``VLLM_SERVER_DEV_MODE=1``):
how long each operation took, and how many of each are being awaited now.

The series live in the server's registry (``PrometheusStatLogger.registry``), so /metrics
shows them beside the engine's. With several API servers (``--api-server-count``) the
values go to prometheus_client's multiprocess files, as every other series does: the
histograms sum over the servers, the in-flight gauge counts the live servers' calls.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from prometheus_client import CollectorRegistry, Gauge, Histogram

DURATION = "vllm:rl_weight_update_operation_duration_seconds"
IN_FLIGHT = "vllm:rl_weight_update_operations_in_flight"
# The five transfer routes, as vLLM labels them.
OPERATIONS = ("init", "shutdown", "start", "update", "finish")
Operation = Literal["init", "shutdown", "start", "update", "finish"]
BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)


class WeightTransferMetrics:
    """The two series, labelled ``operation``; ``record`` wraps one call."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        """``registry`` None: the series exist but are registered nowhere (a test's app)."""
        self.duration = Histogram(
            DURATION,
            "Duration of one weight-transfer operation, in seconds.",
            ["operation"],
            buckets=BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            IN_FLIGHT,
            "Weight-transfer operations being awaited now.",
            ["operation"],
            multiprocess_mode="livesum",
            registry=registry,
        )

    @contextmanager
    def record(self, operation: Operation) -> Iterator[None]:
        """In flight while the block runs; its duration is observed however it ends (a
        failed call, a 400, counts too, as vLLM's)."""
        in_flight = self.in_flight.labels(operation)
        in_flight.inc()
        started = time.perf_counter()
        try:
            yield
        finally:
            in_flight.dec()
            self.duration.labels(operation).observe(time.perf_counter() - started)


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, WeightTransferMetrics] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def weight_transfer_metrics(registry: CollectorRegistry | None) -> WeightTransferMetrics:
    """The registry's series, created on first use: an app built twice over one registry
    (tests do) shares them instead of registering the names twice."""
    if registry is None:
        return WeightTransferMetrics(None)
    with _lock:
        metrics = _by_registry.get(registry)
        if metrics is None:
            metrics = _by_registry[registry] = WeightTransferMetrics(registry)
        return metrics
