"""benchmarks/benchmark_dp.py: one small run (the figures are measured on a quiet machine,
docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_dp.py"


@pytest.mark.slow
def test_both_routings_run(capsys):
    bench = load_script(SCRIPT)
    assert bench.main(["--jobs", "2", "--turns", "2", "--tool-s", "0"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if "%" in line}
    assert set(rows) == {"affinity", "alternating"}
    # Affinity finds each job's history; alternating never does (the history is always
    # on the other engine, and only the system prompt's blocks repeat there).
    assert int(rows["affinity"][1].rstrip("%")) > int(rows["alternating"][1].rstrip("%"))
