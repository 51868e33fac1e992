"""benchmarks/benchmark_recurrent_tier.py at a small size: both modes give the same
answers; without the tier the later turns find nothing cached (their blocks and
checkpoints were pushed out), with it they come back from host memory."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import benchmark_recurrent_tier as bench  # noqa: E402


def test_small_run(tmp_path):
    out = tmp_path / "tier.json"
    argv = ["--hidden", "64", "--layers", "4", "--jobs", "3", "--turns", "2",
            "--prompt-len", "100", "--max-tokens", "8", "--tool-len", "12",
            "--chunk-tokens", "64", "--tier-gib", "0.01", "--json-out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["same_answers"] and "cpu" in result["machine"]
    none, tier = result["runs"]
    assert none["later_cached_tokens"] == 0 and none["offloads"] == 0
    assert tier["tier_state_slots"] > 0 and tier["offloads"] > 0 and tier["restores"] == 3
    assert tier["later_cached_tokens"] >= 3 * 96  # each job's later turn: its first's
    assert tier["later_computed_tokens"] < none["later_computed_tokens"]
