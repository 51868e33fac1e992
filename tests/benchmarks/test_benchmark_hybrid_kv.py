"""benchmarks/benchmark_hybrid_kv.py: the computed bytes of real shapes (gpt-oss halves a
long context, Mistral v0.1 keeps one window), and a small measured run of both engines in
a child process whose rows carry their own ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import benchmark_hybrid_kv as bench  # noqa: E402


def test_computed_request_bytes():
    rows = {(r["shape"], r["context"]): r for s in bench.SHAPES for r in
            bench.request_bytes(s, chunk=8192, kv_gib=64.0)}  # fmt: skip
    # gpt-oss-20b: 24 layers x 8 KV heads x 64 x 2 (K, V) x 2 bytes = 48 KiB a token.
    long = rows[("gpt-oss-20b", 131072)]
    assert long["uniform_gib"] == pytest.approx(131072 * 48 / 2**20)
    assert long["decoding_ratio"] == pytest.approx(2.0, abs=0.01)  # half the layers: 128 tokens
    assert long["hybrid_fit"] == 2 * long["uniform_fit"]
    # A prefill step of 8k tokens holds them all in the sliding group too: no saving then.
    assert rows[("gpt-oss-20b", 8192)]["ratio"] == pytest.approx(1.0)
    # Mistral v0.1 (every layer over 4,096): decoding 32k tokens holds a window's blocks.
    assert rows[("mistral-7b-v0.1", 32768)]["decoding_ratio"] == pytest.approx(32768 / 4112)
    assert ("gemma-2-9b", 32768) not in rows  # past its 8,192 positions
    assert "7 group(s) of 10 layers" in rows[("gemma-3-27b", 8192)]["groups"]


@pytest.mark.slow
def test_measured_run(tmp_path):
    out = tmp_path / "hybrid.json"
    argv = ["--layers", "2", "--num-requests", "3", "--prompt-len", "200", "--max-tokens", "4",
            "--chunk-tokens", "64", "--window", "16", "--kv-mib", "0.5",
            "--json-out", str(out)]  # fmt: skip
    script = REPO / "benchmarks" / "benchmark_hybrid_kv.py"
    done = subprocess.run([sys.executable, str(script), *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["engine"]
    assert [r["hybrid"] for r in runs] == [False, True]
    assert runs[0]["windows"] == [None] and runs[1]["windows"] == [None, 16]
    assert runs[1]["num_blocks"] == 2 * runs[0]["num_blocks"]  # half the bytes a block
    for r in runs:
        assert r["output_tok_s"] > 0 and r["steps"] > 0
    assert runs[1]["ratio"] == pytest.approx(runs[1]["output_tok_s"] / runs[0]["output_tok_s"])
    assert result["machine"]["cpu"] and result["machine"]["vector_extensions"]
