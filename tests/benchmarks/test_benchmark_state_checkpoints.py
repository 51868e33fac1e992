"""benchmarks/benchmark_state_checkpoints.py at a small size: both modes give the same
answers, later turns find their history cached (restored from checkpoints) only with
prefix caching, and the JSON carries the figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import benchmark_state_checkpoints as bench  # noqa: E402


def test_small_run(tmp_path):
    out = tmp_path / "checkpoints.json"
    argv = ["--hidden", "64", "--layers", "4", "--jobs", "1", "--turns", "3",
            "--prompt-len", "100", "--max-tokens", "8", "--tool-len", "12",
            "--chunk-tokens", "64", "--json-out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["same_answers"] and "cpu" in result["machine"]
    off, on = result["runs"]
    assert off["cached_tokens"] == 0 and off["restores"] == 0
    # turns 2 and 3 restart from a checkpoint of the last turn (a block boundary)
    assert on["restores"] == 2 and on["cached_tokens"] >= 2 * 96
    assert on["computed_tokens"] < off["computed_tokens"]
    assert [t["cached_tokens"] % 16 for t in on["turns"]] == [0, 0, 0]
