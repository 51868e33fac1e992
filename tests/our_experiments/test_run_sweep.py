"""run_sweep's bookkeeping: what it records next to the results, without a server."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from our_experiments.scripts import run_sweep
from our_experiments.scripts.workload import ROOT, repo_relative


def test_repo_relative_paths_inside_the_repository_only(tmp_path):
    assert repo_relative(ROOT / "our_experiments" / "results") == "our_experiments/results"
    assert repo_relative(tmp_path / "t.jsonl") == str(tmp_path / "t.jsonl")


def test_sweep_config_records_relative_paths_and_keeps_earlier_records(tmp_path):
    trace = ROOT / "our_experiments" / "traces" / "example_trace.jsonl"
    args = SimpleNamespace(results_dir=run_sweep.RESULTS, trace=trace, jps=[0.1], seed=0)
    first = run_sweep.write_config(args, tmp_path)
    second = run_sweep.write_config(args, tmp_path)
    assert (first.name, second.name) == ("sweep_config.json", "sweep_config.2.json")
    config = json.loads(first.read_text())
    assert config["results_dir"] == "our_experiments/results"
    assert config["trace"] == "our_experiments/traces/example_trace.jsonl"
    assert config["jps"] == [0.1] and "started" in config


def test_committed_sweep_configs_name_no_machine_paths():
    configs = sorted((ROOT / "our_experiments" / "results").glob("*/sweep_config*.json"))
    assert configs
    for path in configs:
        config = json.loads(path.read_text())
        for key in ("results_dir", "trace"):
            value = config.get(key)
            assert value is None or not Path(value).is_absolute(), (path, key, value)


def test_study_labels_compose_a_variant_with_a_tier_sized_from_the_pool():
    gib = 4 * 400 * run_sweep.BLOCK_BYTES / 2**30
    assert run_sweep.policy_flags("fcfs", 400) == ("fcfs", [])
    assert run_sweep.policy_flags("fcfs+offload4x", 400) == (
        "fcfs",
        ["--kv-offloading-size", f"{gib:.3f}"],
    )
    assert run_sweep.policy_flags("continuum-admission+offload16x", 100) == (
        "continuum",
        ["--continuum-job-admission", "--kv-offloading-size", f"{gib:.3f}"],
    )
    assert run_sweep.policy_flags("continuum-noadmission", 400) == (
        "continuum",
        ["--no-continuum-job-admission"],
    )
    assert run_sweep.policy_flags("context_serve-admission+offload4x", 400) == (
        "context_serve",
        ["--continuum-job-admission", "--kv-offloading-size", f"{gib:.3f}"],
    )
    with pytest.raises(ValueError, match="--policies"):
        run_sweep.policy_flags("fcfs+offload0x", 400)
    with pytest.raises(ValueError, match="agent-aware"):
        run_sweep.policy_flags("fcfs-admission", 400)
