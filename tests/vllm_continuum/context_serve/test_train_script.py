"""our_experiments/scripts/train_context_serve.py: recorder files in, a loadable model out."""

from __future__ import annotations

import json

from our_experiments.scripts import train_context_serve as script
from vllm_continuum.context_serve.xgb import XGBoostModel


def job(t0: float, command: str, seconds: float, key: str = "command") -> list[dict]:
    return [
        {"event": "arrival", "time": t0, "request": "r1"},
        {"event": "departure", "time": t0 + 1, "is_last_step": False, key: command},
        {"event": "pinned", "time": t0 + 1, "ttl_s": 2.0},
        {"event": "arrival", "time": t0 + 1 + seconds, "request": "r2"},
        {"event": "departure", "time": t0 + 2 + seconds, "is_last_step": True, key: "ls"},
    ]


def test_samples_pair_departures_with_next_arrivals():
    assert script.job_samples(job(0.0, "make -j4", 30.0)) == [("make -j4", 30.0)]
    assert script.job_samples(job(0.0, "ls", 0.5, key="func_call")) == [("ls", 0.5)]
    assert script.job_samples([{"event": "departure", "time": 1.0, "command": "ls"}]) == []


def test_trains_a_model_that_the_policy_loads(tmp_path, capsys):
    jobs = {}
    for i in range(60):
        fast = i % 2 == 0
        command = ["ls -la", "cat a.py", "git status"][i % 3] if fast else "pytest tests/"
        jobs[f"job{i}"] = job(i * 100.0, command, 0.2 if fast else 40.0)
    run = tmp_path / "run1"
    run.mkdir()
    (run / "scheduler_timestamps.json").write_text(json.dumps(jobs))
    out = tmp_path / "model.json"
    assert script.main([str(tmp_path), "--output", str(out)]) == 0
    assert "60" in capsys.readouterr().out
    model = XGBoostModel.load(str(out))
    assert model.probabilities("pytest tests/unit")[1] > 0.5 < model.probabilities("ls -la src")[0]
    assert script.main([str(run / "scheduler_timestamps.json"), "--output", str(out),
                        "--fast-threshold", "100"]) == 1  # fmt: skip
