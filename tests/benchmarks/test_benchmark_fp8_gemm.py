"""benchmarks/benchmark_fp8_gemm.py on the tiny shape, its kernels in Triton's interpreter
(a child process): every layer and token count timed, the ratio and bandwidth computed from
the row's own figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_tiny_shape_rows_interpreted(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "fp8.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "1", "20",
            "--repeats", "1", "--json-out", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "benchmark_fp8_gemm.py"),
                           *argv], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [(r["layer"], r["tokens"]) for r in rows] == [
        (layer, n) for layer in ("qkv", "o", "experts") for n in (1, 20)
    ]
    assert rows[0]["weight_bytes"] == 160 * 128 + 2 * 1 * 4  # 2 x 1 blocks of scales
    assert rows[4]["experts_hit"] == 2  # top 2 of 8, one token
    for row in rows:
        assert row["ratio"] == pytest.approx(row["fp8_ms"] / row["dense_ms"])
        assert row["fp8_gb_s"] == pytest.approx(row["weight_bytes"] / row["fp8_ms"] / 1e6)
    assert "fp8/dense" in done.stdout


def test_gpu_kit_runs_the_fp8gemm_step(tmp_path):
    # scripts/gpu/run.sh's fp8gemm step on the CPU (its kernels interpreted): the JSON and
    # the step's status land under $OUT.
    pytest.importorskip("triton")
    kit = REPO / "scripts" / "gpu" / "run.sh"
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path),
                        "TRITON_INTERPRET": "1"}  # fmt: skip
    argv = ["fp8gemm", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens",
            "3", "--repeats", "1"]  # fmt: skip
    done = subprocess.run([str(kit), *argv], env=env, timeout=300, capture_output=True)
    assert done.returncode == 0, done.stdout.decode()[-2000:]
    rows = json.loads((tmp_path / "fp8gemm-1.json").read_text())["rows"]
    assert {r["tokens"] for r in rows} == {3}
    assert "=== fp8gemm: exit status 0" in (tmp_path / "run.log").read_text()
