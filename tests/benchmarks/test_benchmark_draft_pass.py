"""benchmarks/benchmark_draft_pass.py: its rows from an engine's figures, and a whole run on
the CPU with the tiny target and draft (no CUDA graphs there: the graphs column is null,
the target's step eager), directly and as scripts/gpu/run.sh's draft-pass step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "benchmark_draft_pass.py"
TINY_RUN = ["--target-shape", "tiny", "--draft-shape", "tiny-draft", "--num-spec-tokens", "2",
            "--batches", "1", "2", "--prompt-len", "16", "--repeats", "3",
            "--warmup", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


def figures(pass_ms: float, draft_replays: float, target_ms: float, target_replays: float):
    return {"context": 18.0, "target_step_ms": target_ms,
            "target_replays_per_step": target_replays,
            "draft": {"2": {"pass_ms": pass_ms, "replays_per_pass": draft_replays}}}  # fmt: skip


def test_rows_from_replayed_and_eager_figures(bench):
    args = bench.parse_args(["--num-spec-tokens", "2", "--batches", "1", "64"])
    engines = {
        # Batch 1 replayed (2 replays a pass of k = 2, 1 a target step); batch 64 failed
        # in the default engine, so its target step is the eager engine's.
        "default": {"1": figures(1.5, 2, 5.0, 1), "64": {"error": "RuntimeError: x"}},
        "eager": {"1": figures(6.0, 0, 12.0, 0), "64": figures(9.0, 0, 20.0, 0)},
    }
    one, sixty_four = bench.summary_rows(engines, args)
    assert one["draft_pass_ms_graphs"] == 1.5 and one["draft_pass_ms_eager"] == 6.0
    assert one["target_step_ms"] == 5.0 and one["target_step_graphs"]
    assert one["ratio_graphs"] == pytest.approx(1.5 / (2 * 5.0))
    assert one["ratio_eager"] == pytest.approx(6.0 / (2 * 5.0))
    assert one["graphs_speedup"] == pytest.approx(4.0)
    assert sixty_four["draft_pass_ms_graphs"] is None and sixty_four["graphs_speedup"] is None
    assert sixty_four["target_step_ms"] == 20.0 and not sixty_four["target_step_graphs"]
    # A default engine that replayed nothing (a CPU) has no graphs figure either.
    engines["default"]["1"] = figures(6.1, 0, 12.1, 0)
    assert bench.summary_rows(engines, args)[0]["draft_pass_ms_graphs"] is None


def test_the_draft_needs_the_targets_vocabulary(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--target-shape", "llama-3.1-8b", "--draft-shape", "tiny"])
    assert "vocabulary" in capsys.readouterr().err


def check_cpu_run(result: dict) -> None:
    assert result["machine"]["device"] == "cpu" and result["machine"]["cpu"]
    assert result["machine"]["vector_extensions"]
    assert result["graphs"] == {e: {"target": False, "draft": False} for e in ("default", "eager")}
    assert [(r["k"], r["batch"]) for r in result["rows"]] == [(2, 1), (2, 2)]
    for row in result["rows"]:
        # Prompt, the prefill's token, and at least one from the first decode step.
        assert row["context"] >= 18
        assert row["draft_pass_ms_graphs"] is None and row["graphs_speedup"] is None
        assert row["draft_pass_ms_eager"] > 0 and row["target_step_ms"] > 0
        assert row["target_step_ms_eager"] > 0 and not row["target_step_graphs"]
        assert row["ratio_eager"] == pytest.approx(
            row["draft_pass_ms_eager"] / (2 * row["target_step_ms"])
        )
    for by_batch in result["engines"].values():
        for f in by_batch.values():
            assert f["draft"]["2"]["replays_per_pass"] == 0 == f["target_replays_per_step"]


@pytest.mark.slow
def test_tiny_run_on_the_cpu(bench, tmp_path, capsys):
    out = tmp_path / "draft.json"
    try:
        code = bench.main(TINY_RUN + ["--model-dir", str(tmp_path), "--json-out", str(out)])
    except SystemExit as e:  # no tokenizer files on this machine
        pytest.skip(str(e))
    assert code == 0
    check_cpu_run(json.loads(out.read_text()))
    assert "graphs/(k*tgt)" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_tiny_eagle_run_on_the_cpu(bench, tmp_path, method):
    """--method eagle/eagle3: a one-layer head of the target's shape instead of the draft
    (EAGLE-3's over a 32,000-token draft vocabulary), timed the same way."""
    out = tmp_path / "eagle.json"
    try:
        code = bench.main([*TINY_RUN, "--method", method, "--model-dir", str(tmp_path),
                           "--json-out", str(out)])  # fmt: skip
    except SystemExit as e:  # no tokenizer files on this machine
        pytest.skip(str(e))
    assert code == 0
    result = json.loads(out.read_text())
    check_cpu_run(result)
    assert result["method"] == method == result["draft_shape"]
    head = json.loads((tmp_path / f"tiny-{method}-head" / "config.json").read_text())
    assert head["num_hidden_layers"] == 1
    assert head.get("draft_vocab_size") == (32000 if method == "eagle3" else None)


@pytest.mark.slow
def test_gpu_kit_runs_the_draft_pass_step(tmp_path):
    kit = REPO / "scripts" / "gpu" / "run.sh"
    env = os.environ | {"GPU_RUN_NO_WHEELS": "1", "PYTHON": sys.executable, "OUT": str(tmp_path),
                        "PYTHONPATH": str(REPO)}  # fmt: skip
    argv = ["draft-pass", *TINY_RUN, "--model-dir", str(tmp_path / "models")]
    done = subprocess.run([str(kit), *argv], env=env, timeout=300, capture_output=True)
    log = (tmp_path / "run.log").read_text()
    if "no tokenizer files" in log:
        pytest.skip("no tokenizer files on this machine")
    assert done.returncode == 0, done.stdout.decode()[-3000:]
    check_cpu_run(json.loads((tmp_path / "draft-pass-1.json").read_text()))
    assert "=== draft-pass: exit status 0" in log
