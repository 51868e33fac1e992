"""benchmarks/benchmark_api_server.py end to end on a tiny run: a real `vllm serve`, both
sides' CPU per token, stream intervals interleaved, one and two API server processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_api_server.py"
pytestmark = pytest.mark.slow


def test_tiny_run_measures_both_processes_per_interval(tmp_path, capsys):
    module = load_script(SCRIPT)
    out = tmp_path / "api.json"
    argv = ["--num-requests", "2", "--max-tokens", "6", "--repeats", "1",
            "--stream-intervals", "1", "4", "--model-dir", str(tmp_path / "model"),
            "--shape", "tiny", "--serve-args", "--max-num-seqs 3",
            "--api-server-counts", "1", "2"]  # fmt: skip
    assert module.main([*argv, "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    keys = [(r["api_server_count"], r["num_requests"], r["stream_interval"]) for r in rows]
    assert keys == [(1, 2, 1), (1, 2, 4), (2, 2, 1), (2, 2, 4)]
    for r in rows:
        med = r["median"]
        assert med["tokens"] == 12  # the run checks the usage chunks add up to this
        # CPU times tick at 10 ms: a run this short may read 0 for either process.
        assert med["api_us_per_token"] >= 0 and med["engine_us_per_token"] >= 0
        assert med["wall_s"] > 0 and med["tok_per_s"] > 0
    for one, four in ((rows[0], rows[1]), (rows[2], rows[3])):
        one, four = one["median"]["events_per_token"], four["median"]["events_per_token"]
        # Interval 4 of 6 tokens: the first at once, the next 4, then the last: 3 chunks.
        assert 0 < four <= 0.5 and four < one <= 1.0
    printed = capsys.readouterr().out
    assert "API us/tok" in printed and "tiny float32" in printed


def test_gpu_kit_runs_the_api_step(tmp_path):
    import os
    import subprocess
    import sys

    kit = SCRIPT.parents[1] / "scripts" / "gpu" / "run.sh"
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    argv = ["api", "--shape", "tiny", "--num-requests", "2", "--max-tokens", "4", "--repeats",
            "1", "--model-dir", str(tmp_path / "model")]  # fmt: skip
    done = subprocess.run([str(kit), *argv], env=env, timeout=180, capture_output=True)
    assert done.returncode == 0, done.stdout.decode()[-2000:]
    assert json.loads((tmp_path / "api-1.json").read_text())["rows"][0]["median"]["tokens"] == 8
    assert "=== api: exit status 0" in (tmp_path / "run.log").read_text()
