"""benchmarks/benchmark_offload.py: load-versus-recompute on a random-weight shape (dummy
weights, no checkpoint), chunked like the engine's prefill, with every figure in its JSON;
the same run on CUDA is a cuda test (issue 28's GPU figures come from it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_offload.py"
ARGS = ["--shape", "tiny", "--contexts", "64", "256", "--chunk-tokens", "128", "--repeats", "1"]


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


def check(result: dict, device: str) -> None:
    assert result["machine"]["device"] == device
    assert result["pinned"] == (device == "cuda")
    rows = result["rows"]
    assert [r["tokens"] for r in rows] == [64, 256]
    assert [r["blocks"] for r in rows] == [4, 16]
    assert [r["chunks"] for r in rows] == [1, 2]  # 256 tokens in chunks of 128
    for r in rows:
        for key in ("prefill_s", "load_s", "load_scattered_s", "load_scattered_unstaged_s",
                    "save_s", "save_scattered_s", "load_gb_per_s", "scattered_ratio"):  # fmt: skip
            assert r[key] > 0, key
        one_stream = {"load_scattered_one_stream_s", "save_scattered_one_stream_s"}
        if device == "cuda":  # the staged pipeline against its two stages on one stream
            assert all(r[key] > 0 for key in one_stream)
        else:
            assert not one_stream & set(r)  # one path on the CPU: nothing to compare
        assert r["ratio"] == pytest.approx(r["prefill_s"] / r["load_s"])
        expected_gbps = r["blocks"] * result["kv_block_bytes"] / r["load_s"] / 1e9
        assert r["load_gb_per_s"] == pytest.approx(expected_gbps)


def test_tiny_shape_on_this_machine(bench, tmp_path, capsys):
    out = tmp_path / "offload.json"
    assert bench.main([*ARGS, "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    check(result, "cuda" if torch.cuda.is_available() else "cpu")
    # tiny: 2 layers x K/V x 16 tokens x 2 KV heads x 32 dims, fp32 on CPU
    itemsize = 2 if torch.cuda.is_available() else 4
    assert result["kv_block_bytes"] == 2 * 2 * 16 * 2 * 32 * itemsize
    assert "load GB/s" in capsys.readouterr().out


def test_contexts_must_be_whole_blocks(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--contexts", "100"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tiny_shape_on_cuda_bf16(bench, tmp_path):
    out = tmp_path / "offload.json"
    assert bench.main([*ARGS, "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    check(result, "cuda")
    assert result["dtype"] == "bfloat16"


def test_run_sh_runs_an_offload_step(tmp_path):
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    kit = SCRIPT.parents[1] / "scripts" / "gpu" / "run.sh"
    done = subprocess.run([str(kit), "offload", *ARGS], env=env, timeout=300)
    assert done.returncode == 0, (tmp_path / "run.log").read_text()[-3000:]
    check(json.loads((tmp_path / "offload-1.json").read_text()), "cpu")
