"""benchmarks/benchmark_sampler.py: a batch sampled together against row by row, with the
same tokens, on a small vocabulary; and the GPU kit's step that runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_sampler.py"
TINY = ["--num-requests", "1", "5", "--vocab", "300", "--prompt-len", "20",
        "--output-len", "6", "--repeats", "1", "--device", "cpu"]  # fmt: skip


def test_rows_together_and_alone_give_the_same_tokens(tmp_path, capsys):
    bench = load_script(SCRIPT)
    out = tmp_path / "sampler.json"
    assert bench.main(TINY + ["--mix", "both", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["num_requests"] for r in report["results"]] == [1, 5]
    for r in report["results"]:
        assert r["same_tokens"] is True
        assert r["speedup"] == round(r["row_by_row_ms"] / r["together_ms"], 2)
    assert report["machine"]["cpu_count"] and report["args"]["mix"] == "both"
    assert "| 5 |" in capsys.readouterr().out


def test_gpu_kit_runs_the_sampler_step(tmp_path):
    kit = SCRIPT.parents[1] / "scripts" / "gpu" / "run.sh"
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run([str(kit), "sampler", *TINY], env=env, timeout=120, capture_output=True)
    assert done.returncode == 0, done.stdout.decode()[-2000:]
    report = json.loads((tmp_path / "sampler-1.json").read_text())
    assert report["results"][1]["num_requests"] == 5
    assert "=== sampler: exit status 0" in (tmp_path / "run.log").read_text()


def test_top_p_ab_ranks_by_both_sorts_with_the_same_tokens(tmp_path, capsys):
    bench = load_script(SCRIPT)
    out = tmp_path / "top-p.json"
    argv = ["--top-p-ab", "--logits", "random", "--vocab", "3000", "--num-requests", "1", "6",
            "--repeats", "1", "--device", "cpu", "--json-out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    rows = report["top_p_ab"]
    assert [r["num_requests"] for r in rows] == [1, 6]
    for r in rows:
        assert r["same_tokens"] is True
        assert r["speedup"] == round(r["sort_ms"] / r["numpy_ms"], 2)
        assert 1 <= r["nucleus_median"] <= r["nucleus_max"] <= 3000
    assert report["end_to_end"] is None  # only with the embedded model's logits
    assert "| 6 |" in capsys.readouterr().out


def test_penalty_table_ab_samples_the_same_tokens_both_ways(tmp_path, capsys):
    bench = load_script(SCRIPT)
    out = tmp_path / "penalties.json"
    assert bench.main(TINY + ["--penalty-table-ab", "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["num_requests"] for r in rows] == [1, 5]
    for r in rows:
        assert r["same_tokens"] is True
        assert r["ratio"] == round(r["histories_ms"] / r["tables_ms"], 2)
        assert r["host_entries_ms"] > 0 and r["table_mib"] > 0
    assert "| 5 |" in capsys.readouterr().out
    try:
        bench.main(TINY + ["--penalty-table-ab", "--mix", "filters"])
    except SystemExit as e:  # argparse's error: a mix without penalties has nothing to time
        assert e.code == 2
    else:
        raise AssertionError("--penalty-table-ab --mix filters was accepted")
    assert "needs a --mix with penalties" in capsys.readouterr().err
    try:
        bench.main(TINY + ["--end-to-end"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--end-to-end without --penalty-table-ab was accepted")


def test_rejection_ab_verifies_the_same_tokens_together_and_alone(tmp_path, capsys):
    bench = load_script(SCRIPT)
    out = tmp_path / "rejection.json"
    args = ["--rejection-ab", "--num-spec-tokens", "2", "--json-out", str(out)]
    assert bench.main(TINY + args) == 0
    report = json.loads(out.read_text())
    assert [r["num_requests"] for r in report["results"]] == [1, 5]
    for r in report["results"]:
        assert r["same_tokens"] is True and r["num_spec_tokens"] == 2
        assert 0 <= r["kept_per_request"] <= 2
    assert "| 5 | 2 |" in capsys.readouterr().out
