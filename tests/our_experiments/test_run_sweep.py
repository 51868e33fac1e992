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


def _args(**kw) -> SimpleNamespace:
    base = dict(engine="ours", identity="job_id", replicas=1, routing_policy="consistent_hash")
    return SimpleNamespace(**{**base, **kw})


def test_point_labels_name_the_identity_and_the_router():
    assert run_sweep.point_label(_args(), "continuum") == "continuum"
    assert run_sweep.point_label(_args(identity="prompt_cache_key"), "fcfs") == "fcfs+key"
    assert run_sweep.point_label(_args(identity="x-session-id"), "fcfs") == "fcfs+session"
    routed = _args(identity="x-session-id", replicas=2, routing_policy="round_robin")
    assert run_sweep.point_label(routed, "continuum") == "continuum+router2-round_robin"
    assert run_sweep.point_label(_args(engine="upstream"), "fcfs") == "upstream-fcfs"


@pytest.mark.parametrize(
    "argv",
    [
        ["--replicas", "2"],  # job_id: the router would send every job to one replica
        ["--replicas", "2", "--identity", "x-session-id", "--engine", "upstream"],
        ["--replicas", "0"],
    ],
)
def test_router_points_need_the_session_identity(monkeypatch, tmp_path, argv):
    monkeypatch.setattr("sys.argv", ["run_sweep", "--results-dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit) as info:
        run_sweep.main()
    assert info.value.code == 2 and not any(tmp_path.iterdir())  # refused before any point
