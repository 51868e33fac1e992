"""benchmarks/benchmark_recurrent_spec.py at a small size: every mode's answers are the
plain greedy ones, and the oracle's drafts are kept when right, rejected when wrong."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import benchmark_recurrent_spec as bench  # noqa: E402


def test_small_run(tmp_path):
    out = tmp_path / "spec.json"
    argv = ["--hidden", "64", "--layers", "4", "--requests", "2", "--prompt-len", "20",
            "--max-tokens", "12", "--wrong", "0", "1", "--json-out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["same_answers"] and "cpu" in result["machine"]
    none, right, wrong = result["runs"]
    assert none["drafts"] == 0
    assert right["drafts"] > 0 and right["accepted"] == right["drafts"]
    assert wrong["drafts"] > 0 and wrong["accepted"] == 0
