"""benchmarks/benchmark_weight_transfer.py: one weight-sync round into vllm serve and the
restart baseline, once (the figures are measured on a quiet machine, docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_weight_transfer.py"


@pytest.mark.slow
def test_a_round_and_the_restart_baseline_run(capsys):
    bench = load_script(SCRIPT)
    assert bench.main(["--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "round (pause, start, update, finish, resume):" in out
    assert "MB/s" in out and "baseline / round:" in out
