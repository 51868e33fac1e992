"""benchmarks/benchmark_pd.py: one small run (the figures are measured on a quiet machine,
docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_pd.py"


@pytest.mark.slow
def test_fetched_and_computed_and_a_jobs_turns_run(capsys):
    bench = load_script(SCRIPT)
    args = ["--lengths", "64", "--repeats", "1", "--turns", "2", "--turn-tokens", "40"]
    assert bench.main([*args, "--blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert "computed/fetched" in out and "MB/s" in out
    turns = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    # The second turn fetches only its new blocks: fewer than its prompt's.
    turn2 = next(row for row in turns if row[0] == "2" and len(row) == 6)
    assert 0 < int(turn2[3]) < int(turn2[2])
