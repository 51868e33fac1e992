"""benchmarks/benchmark_spec_decode.py end to end on a short run: both engines, the
figures in its JSON, and the outputs identical (greedy speculation is exact)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_spec_decode.py"

pytestmark = pytest.mark.slow


def test_short_run_reports_both_engines(tmp_path):
    out = tmp_path / "spec.json"
    args = ["--k", "3", "--concurrency", "1", "--max-tokens", "24", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "machine:" in proc.stdout and "speedup" in proc.stdout
    (run,) = json.loads(out.read_text())["runs"]
    assert run["identical"] and run["k"] == 3
    plain, ngram = run["plain"], run["ngram"]
    assert plain["output_tokens"] == ngram["output_tokens"] > 0
    assert plain["steps"] == plain["output_tokens"]  # one request at a time: a token a step
    assert 0 < ngram["accepted_tokens"] <= ngram["draft_tokens"]
    assert ngram["steps"] < plain["steps"]
