"""benchmarks/benchmark_kv_events.py: a step's cost with and without KV cache events, on a
few steps (the figures themselves are measured on a quiet machine, docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_kv_events.py"


def test_both_runs_step_and_the_events_reach_the_subscriber(capsys):
    bench = load_script(SCRIPT)
    assert bench.main(["--steps", "40", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "step without events:" in out and "ratio" in out
    published = out.split("published: ")[1]
    assert float(published.split(" batches/step")[0]) > 0  # the pool churned: events came
