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
