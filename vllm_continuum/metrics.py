"""Metrics declared as data: what a policy exports, independent of any metrics library.

A policy lists its series as ``MetricSpec`` s (our engine: ``Policy.metrics()``); an
engine's exporter builds one Prometheus series per spec and, for each stats object the
policy reports (``Policy.make_stats``), applies the spec's ``read`` samples: a counter is
incremented by each value, a gauge set to it, a histogram observes it. Specs name no
engine label: the exporter adds its own (``model_name``, ...) in front of ``labels``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

MetricKind = Literal["counter", "gauge", "histogram"]
METRIC_KINDS: tuple[MetricKind, ...] = ("counter", "gauge", "histogram")

# (values of the spec's ``labels``, in order; the value to add, set or observe)
Sample = tuple[tuple[str, ...], float]
Reader = Callable[[Any], Iterable[Sample]]


def _no_samples(stats: Any) -> Iterable[Sample]:
    return ()


@dataclass(frozen=True)
class MetricSpec:
    """One series. ``name`` is the full Prometheus name (counters without ``_total``,
    which the client appends); ``read(stats)`` yields its samples from one stats report
    (nothing for a series the exporter feeds itself)."""

    name: str
    kind: MetricKind
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None  # histograms only
    read: Reader = _no_samples

    def __post_init__(self) -> None:
        if self.kind not in METRIC_KINDS:
            raise ValueError(f"{self.name}: kind must be one of {METRIC_KINDS}, got {self.kind!r}")
        if (self.buckets is not None) != (self.kind == "histogram"):
            raise ValueError(f"{self.name}: buckets are for histograms (and they need them)")
        if self.kind == "counter" and self.name.endswith("_total"):
            raise ValueError(f"{self.name}: a counter's name is given without '_total'")

    def samples(self, stats: Any) -> list[Sample]:
        """``read(stats)`` checked against ``labels`` (a wrong arity is a declaration bug)."""
        out = list(self.read(stats))
        for values, _ in out:
            if len(values) != len(self.labels):
                raise ValueError(f"{self.name}: sample labels {values!r} for {self.labels!r}")
        return out


# -- readers for the common shapes of a stats object -----------------------------------
def value_of(attr: str) -> Reader:
    """One unlabelled sample: ``stats.<attr>``."""
    return lambda stats: [((), getattr(stats, attr))]


def each_of(attr: str) -> Reader:
    """One unlabelled sample per item of the list ``stats.<attr>`` (histogram values)."""
    return lambda stats: [((), v) for v in getattr(stats, attr)]


def by_label(attr: str) -> Reader:
    """One sample per entry of the mapping ``stats.<attr>``: key (a label value, or a
    tuple of them) -> value."""
    return lambda stats: [
        (k if isinstance(k, tuple) else (k,), n) for k, n in getattr(stats, attr).items()
    ]


def merge_specs(groups: Iterable[Iterable[MetricSpec]]) -> tuple[MetricSpec, ...]:
    """The specs of several declarations, each name once (a subclass may repeat its
    parent's); ValueError when two declarations give one name different series."""
    merged: dict[str, MetricSpec] = {}
    for specs in groups:
        for spec in specs:
            known = merged.setdefault(spec.name, spec)
            if known != spec:
                raise ValueError(f"metric {spec.name!r} is declared twice, differently")
    return tuple(merged.values())
