"""benchmarks/benchmark_host_overhead.py end to end on a tiny run: every decode step is
timed, and the model's share is inside the step's."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_host_overhead.py"


def test_tiny_run_writes_a_row_per_batch_size(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("benchmark_host_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    out = tmp_path / "host.json"
    argv = ["--num-requests", "1", "3", "--prompt-len", "16", "--max-tokens", "5"]
    assert module.main([*argv, "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["num_requests"] for r in rows] == [1, 3]
    for r in rows:
        assert r["decode_steps"] == 4  # 5 tokens: the first comes with the prefill
        assert 0 < r["model_ms"] < r["step_ms"]
        assert r["host_ms"] > 0
        per_request = r["host_us_per_request"] * r["num_requests"]
        assert abs(per_request - r["host_ms"] * 1e3) < 1e-6
    assert "host us/req" in capsys.readouterr().out
