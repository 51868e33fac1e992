"""benchmarks/benchmark_host_overhead.py end to end on a tiny run: every decode step is
timed, and the model's share is inside the step's."""

from __future__ import annotations

import json
from pathlib import Path

from tests.utils import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_host_overhead.py"


def test_tiny_run_writes_a_row_per_batch_size(tmp_path, capsys):
    module = load_script(SCRIPT)
    out = tmp_path / "host.json"
    argv = ["--num-requests", "1", "3", "--prompt-len", "16", "--max-tokens", "5"]
    assert module.main([*argv, "--json-out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["num_requests"] for r in rows] == [1, 3]
    for r in rows:
        assert r["decode_steps"] == 4  # 5 tokens: the first comes with the prefill
        assert 0 < r["model_ms"] < r["step_ms"]
        assert r["host_ms"] > 0
        per_request = r["host_us_per_request"] * r["num_requests"]
        assert abs(per_request - r["host_ms"] * 1e3) < 1e-6
        assert r["front_ms_per_step"] > 0
    assert "host us/req" in capsys.readouterr().out


def test_ab_sampler_interleaves_both_paths_and_restores_the_flag(tmp_path, capsys):
    import vllm.v1.worker.model_runner as model_runner

    real = model_runner.is_bare_greedy
    module = load_script(SCRIPT)
    out = tmp_path / "ab.json"
    argv = ["--num-requests", "2", "--prompt-len", "16", "--max-tokens", "4", "--ab-sampler", "2"]
    assert module.main([*argv, "--json-out", str(out)]) == 0
    row = json.loads(out.read_text())["ab_sampler"]["2"]
    assert len(row["bare_greedy_host_ms"]) == len(row["general_host_ms"]) == 2
    assert model_runner.is_bare_greedy is real
    assert "bare-greedy host ms" in capsys.readouterr().out


def test_gc_ab_interleaves_frozen_and_thawed_sessions_and_gives_the_hold_back(tmp_path, capsys):
    import gc

    from vllm.utils import gc_utils

    module = load_script(SCRIPT)
    out = tmp_path / "gc.json"
    argv = ["--num-requests", "2", "--prompt-len", "16", "--max-tokens", "4", "--gc-ab", "2"]
    assert module.main([*argv, "--gc-runs", "3", "--json-out", str(out)]) == 0
    arms = json.loads(out.read_text())["ab_gc"]["2"]
    assert set(arms) == {"frozen", "thawed"}
    for sessions in arms.values():
        assert len(sessions) == 2
        for s in sessions:
            assert s["generate_s"] > 0 and s["max_step_ms"] > 0
            assert s["full_collection_ms"] >= s["max_full_collection_ms"] >= 0
    assert gc_utils._holds == 0 and gc.get_freeze_count() == 0  # the LLM shut down
    assert "thawed/frozen generate time" in capsys.readouterr().out


def test_ab_detok_interleaves_both_decodes_and_restores_the_detokenizer(tmp_path, capsys):
    import vllm.v1.engine.detokenizer as detokenizer

    real = detokenizer.IncrementalDetokenizer.__init__
    module = load_script(SCRIPT)
    out = tmp_path / "detok.json"
    argv = ["--num-requests", "2", "--prompt-len", "16", "--max-tokens", "4", "--ab-detok", "2"]
    assert module.main([*argv, "--json-out", str(out)]) == 0
    arms = json.loads(out.read_text())["ab_detok"]["2"]
    assert len(arms["lazy"]) == len(arms["eager"]) == 2
    assert all(r["front_ms_per_step"] > 0 for rows in arms.values() for r in rows)
    assert detokenizer.IncrementalDetokenizer.__init__ is real
    assert "front ms lazy" in capsys.readouterr().out
