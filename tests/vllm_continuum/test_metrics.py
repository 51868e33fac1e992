"""Metrics declared as data: a spec's checks, its readers, merging declarations."""

from __future__ import annotations

from collections import Counter

import pytest

from vllm_continuum.context_serve.stats import CONTEXT_SERVE_METRICS, ContextServeStats
from vllm_continuum.metrics import MetricSpec, by_label, each_of, merge_specs, value_of


@pytest.mark.parametrize(
    "make",
    [
        lambda: MetricSpec("vllm:x", "summary", "doc"),
        lambda: MetricSpec("vllm:x", "histogram", "doc"),  # no buckets
        lambda: MetricSpec("vllm:x", "gauge", "doc", buckets=(1.0,)),
        lambda: MetricSpec("vllm:x_total", "counter", "doc"),  # the client adds _total
    ],
)
def test_a_bad_declaration_is_refused(make):
    with pytest.raises(ValueError, match="vllm:x"):
        make()


def test_readers_turn_a_stats_object_into_samples():
    class Stats:
        depth = 3
        delays = [0.5, 2.0]
        by_kind = Counter({"a": 2})
        by_pair = Counter({("fast", "rules"): 1})

    assert MetricSpec("d", "gauge", "", read=value_of("depth")).samples(Stats) == [((), 3)]
    delays = MetricSpec("t", "histogram", "", buckets=(1.0,), read=each_of("delays"))
    assert delays.samples(Stats) == [((), 0.5), ((), 2.0)]
    kinds = MetricSpec("k", "counter", "", labels=("kind",), read=by_label("by_kind"))
    assert kinds.samples(Stats) == [(("a",), 2)]
    pairs = MetricSpec("p", "counter", "", labels=("speed", "layer"), read=by_label("by_pair"))
    assert pairs.samples(Stats) == [(("fast", "rules"), 1)]
    wrong = MetricSpec("w", "counter", "", labels=("speed",), read=by_label("by_pair"))
    with pytest.raises(ValueError, match="sample labels"):
        wrong.samples(Stats)


def test_merge_keeps_each_series_once_and_refuses_two_meanings():
    a = MetricSpec("vllm:a", "gauge", "A.")
    b = MetricSpec("vllm:b", "counter", "B.")
    assert merge_specs([(a, b), (a,)]) == (a, b)
    with pytest.raises(ValueError, match="vllm:a"):
        merge_specs([(a,), (MetricSpec("vllm:a", "counter", "A."),)])


def test_context_serve_declares_its_series_over_its_stats():
    stats = ContextServeStats(
        decisions=Counter({("slow", "bayes"): 2}),
        prediction_errors_s=[1.5],
        fast_pin_outcomes=Counter({"hit": 1}),
        regret=Counter({"fast_was_slow": 1}),
        trainings=1,
    )
    samples = {spec.name: spec.samples(stats) for spec in CONTEXT_SERVE_METRICS}
    assert samples == {
        "vllm:context_serve_decisions": [(("slow", "bayes"), 2)],
        "vllm:context_serve_prediction_error_seconds": [((), 1.5)],
        "vllm:context_serve_fast_pins": [(("hit",), 1)],
        "vllm:context_serve_regret": [(("fast_was_slow",), 1)],
        "vllm:context_serve_trainings": [(("ok",), 1)],  # no failures: no sample
    }
