"""benchmarks/benchmark_mla_decode.py on the tiny shape, the MLA kernel in Triton's
interpreter (a child process): every batch and context timed on both backends, the ratio
and bandwidth computed from the row's own figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tiny_shape_rows_interpreted(tmp_path, kv_cache_dtype):
    pytest.importorskip("triton")
    out = tmp_path / "mla.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    argv = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1", "3",
            "--contexts", "40", "--repeats", "1", "--kv-cache-dtype", kv_cache_dtype,
            "--json-out", str(out)]  # fmt: skip
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "benchmark_mla_decode.py"),
                           *argv], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["shape"], r["batch"], r["context"]) for r in rows] == [
        ("tiny", 1, 40),
        ("tiny", 3, 40),
    ]
    itemsize = 1 if kv_cache_dtype == "fp8" else 4
    for row in rows:
        assert row["ratio"] == pytest.approx(row["triton_ms"] / row["sdpa_ms"])
        read = row["batch"] * 40 * 64 * itemsize
        assert row["triton_gb_s"] == pytest.approx(read / row["triton_ms"] / 1e6)
    assert "triton/sdpa" in done.stdout
