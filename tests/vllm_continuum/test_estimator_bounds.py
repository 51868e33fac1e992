"""``ToolCallEstimator`` stays bounded whatever tool names the model writes."""

from __future__ import annotations

import pytest

from vllm_continuum.estimator import ToolCallEstimator


def test_tool_histories_are_bounded_least_recently_seen_first():
    est = ToolCallEstimator(max_samples=2, max_tools=3)
    for tool in ("a", "b", "c"):
        est.record(tool, 1.0)
    est.record("a", 2.0)  # "a" is now the most recently seen: "b" is the oldest
    est.record("d", 3.0)
    assert est.durations("b") == [] and est.mean("b") is None
    assert est.durations("a") == [1.0, 2.0] and est.durations("c") == [1.0]
    assert est.durations("d") == [3.0]
    for i in range(10_000):  # a flood of made-up names keeps at most max_tools histories
        est.record(f"tool{i}", 0.5)
    assert sum(bool(est.durations(f"tool{i}")) for i in range(10_000)) == 3
    assert est.durations("tool9999") == [0.5] and est.durations("a") == []
    assert est.num_records == 5000  # the all-tools history has its own bound


def test_bad_bounds_name_the_field():
    with pytest.raises(ValueError, match="max_tools"):
        ToolCallEstimator(max_tools=0)
