"""benchmarks/benchmark_moe.py: every path timed on the tiny shape, the ratio and the
bandwidth computed from the row's own figures, the dense path skipped above its cap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_moe.py"


def test_tiny_shape_rows(tmp_path, capsys):
    bench = load_script(SCRIPT)
    out = tmp_path / "moe.json"
    args = ["--shape", "tiny", "--device", "cpu", "--tokens", "1", "40", "--repeats", "2",
            "--dense-max-tokens", "8", "--json-out", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    assert report["shape"] == "tiny" and report["dtype"] == "torch.float32"
    one, forty = report["rows"]
    assert (one["tokens"], one["experts_hit"]) == (1, 2)  # top 2 of 8
    assert 2 < forty["experts_hit"] <= 8
    assert {"grouped_ms", "loop_ms", "dense_ms"} <= one.keys()
    assert "dense_ms" not in forty  # over --dense-max-tokens
    for row in (one, forty):
        expert_bytes = 3 * 64 * 48 * 4
        seconds = row["grouped_ms"] / 1e3
        assert row["grouped_gb_s"] == pytest.approx(
            row["experts_hit"] * expert_bytes / seconds / 1e9
        )
    printed = capsys.readouterr().out
    assert "machine: " in printed and "loop/grouped" in printed


def test_gpu_kit_runs_the_moe_step(tmp_path):
    import os
    import subprocess
    import sys

    kit = SCRIPT.parents[1] / "scripts" / "gpu" / "run.sh"
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    argv = ["moe", "--shape", "tiny", "--device", "cpu", "--tokens", "3", "--repeats", "1"]
    done = subprocess.run([str(kit), *argv], env=env, timeout=120, capture_output=True)
    assert done.returncode == 0, done.stdout.decode()[-2000:]
    assert json.loads((tmp_path / "moe-1.json").read_text())["rows"][0]["tokens"] == 3
    assert "=== moe: exit status 0" in (tmp_path / "run.log").read_text()
