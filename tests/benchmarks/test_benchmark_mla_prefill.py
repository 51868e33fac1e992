"""benchmarks/benchmark_mla_prefill.py on the tiny shape, the MLA prefill kernel in Triton's
interpreter (a child process): every chunk and prefix timed on both backends, the ratio and
TFLOP/s computed from the row's own figures, and the FLOP count of a causal chunk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from benchmark_mla_prefill import absorbed_flops  # noqa: E402


def test_absorbed_flops_count_the_keys_each_row_sees():
    # A 3-row chunk over 2 cached keys: rows see 3, 4 and 5 keys; each key 2 x (56 + 64)
    # multiply-adds per head (a 64-wide score, a 56-wide value).
    assert absorbed_flops(4, 56, 8, 3, 2) == 2 * 4 * 12 * (56 + 64)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tiny_shape_rows_interpreted(tmp_path, kv_cache_dtype):
    pytest.importorskip("triton")
    out = tmp_path / "mla.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--chunks", "5", "24",
            "--prefixes", "0", "17", "--repeats", "1", "--kv-cache-dtype", kv_cache_dtype,
            "--json-out", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "benchmark_mla_prefill.py"),
                           *argv], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["shape"], r["chunk"], r["prefix"]) for r in rows] == [
        ("tiny", 5, 0),
        ("tiny", 24, 0),
        ("tiny", 5, 17),
        ("tiny", 24, 17),
    ]
    for row in rows:
        assert row["ratio"] == pytest.approx(row["triton_ms"] / row["sdpa_ms"])
        flops = absorbed_flops(4, 56, 8, row["chunk"], row["prefix"])
        assert row["triton_tflop_s"] == pytest.approx(flops / row["triton_ms"] / 1e9)
        assert row["triton_peak_mb"] == row["sdpa_peak_mb"] == 0.0  # not measured on CPU
    assert "triton/sdpa" in done.stdout


def test_gpu_kit_runs_the_mla_steps(tmp_path):
    # scripts/gpu/run.sh's mla-decode and mla-prefill steps on the CPU (the kernels
    # interpreted): each step's JSON and status land under $OUT.
    pytest.importorskip("triton")
    kit = REPO / "scripts" / "gpu" / "run.sh"
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path),
                        "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}  # fmt: skip
    argv = ["mla-decode", "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
            "--batches", "2", "--contexts", "20", "--repeats", "1",
            "mla-prefill", "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
            "--chunks", "5", "--prefixes", "3", "--repeats", "1"]  # fmt: skip
    done = subprocess.run([str(kit), *argv], env=env, timeout=300, capture_output=True)
    assert done.returncode == 0, done.stdout.decode()[-2000:]
    decode = json.loads((tmp_path / "mla-decode-1.json").read_text())
    prefill = json.loads((tmp_path / "mla-prefill-1.json").read_text())
    assert decode and [(r["chunk"], r["prefix"]) for r in prefill] == [(5, 3)]
    log = (tmp_path / "run.log").read_text()
    assert "=== mla-decode: exit status 0" in log and "=== mla-prefill: exit status 0" in log
