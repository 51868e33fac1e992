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
    off = ["--kv-offloading-size", "0"]  # a label without a tier runs without one
    assert run_sweep.policy_flags("fcfs", 400) == ("fcfs", off)
    assert run_sweep.policy_flags("continuum", 400) == ("continuum", off)
    assert run_sweep.policy_flags("continuum+autotier", 400) == ("continuum", [])
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
        ["--no-continuum-job-admission", *off],
    )
    assert run_sweep.policy_flags("context_serve-admission+offload4x", 400) == (
        "context_serve",
        ["--continuum-job-admission", "--kv-offloading-size", f"{gib:.3f}"],
    )
    # Another model's blocks (the 8B shape's 2 MiB in bf16) size the same label's tier.
    assert run_sweep.policy_flags("fcfs+offload4x", 5402, 2 * 2**20) == (
        "fcfs",
        ["--kv-offloading-size", f"{4 * 5402 * 2 / 1024:.3f}"],
    )
    with pytest.raises(ValueError, match="--policies"):
        run_sweep.policy_flags("fcfs+offload0x", 400)
    with pytest.raises(ValueError, match="agent-aware"):
        run_sweep.policy_flags("fcfs-admission", 400)


def _args(**kw) -> SimpleNamespace:
    base = dict(
        engine="ours",
        identity="job_id",
        replicas=1,
        routing_policy=["consistent_hash"],
        num_gpu_blocks=400,
        program_config_json=None,
        router_arg=[],
        program_scheduling=None,
    )
    return SimpleNamespace(**{**base, **kw})


def test_point_labels_name_the_identity_and_the_router():
    assert run_sweep.point_label(_args(), "continuum") == "continuum"
    assert run_sweep.point_label(_args(identity="prompt_cache_key"), "fcfs") == "fcfs+key"
    assert run_sweep.point_label(_args(identity="x-session-id"), "fcfs") == "fcfs+session"
    routed = _args(identity="x-session-id", replicas=2)
    label = run_sweep.point_label(routed, "continuum", "round_robin")
    assert label == "continuum+router2-round_robin"
    assert run_sweep.point_label(_args(engine="upstream"), "fcfs") == "upstream-fcfs"
    program = _args(identity="program_id", replicas=2)
    assert run_sweep.point_label(program, "fcfs", "program") == "fcfs+router2-program"
    # The same requests under another routing: labelled apart from the header-only runs.
    assert run_sweep.point_label(program, "fcfs", "round_robin") == "fcfs+router2-round_robin-pid"
    assert run_sweep.point_label(_args(identity="program_id"), "fcfs") == "fcfs+program_id"


def test_several_routings_behind_a_router_none_before_one_server():
    many = ["consistent_hash", "round_robin", "cache_aware", "program"]
    assert run_sweep.routings(_args(replicas=2, routing_policy=many)) == many
    assert run_sweep.routings(_args(routing_policy=many)) == [None]


def test_program_routing_sizes_the_router_s_admission_by_each_replica_s_pool():
    args = _args(identity="program_id", replicas=2, routing_policy=["round_robin", "program"])
    config = run_sweep.program_config(args)
    assert config["token_capacity_per_dp_rank"] == 400 * 16
    assert config["program_scheduling_enable_key"] == "vllm_xargs.agentic_context"
    args.program_config_json = {"global_queue": False, "binding_only": True}
    config = run_sweep.program_config(args)
    assert config["global_queue"] is False and config["binding_only"] is True
    assert run_sweep.program_config(_args(replicas=2, routing_policy=["round_robin"])) is None
    assert run_sweep.program_config(_args(routing_policy=["program"])) is None  # no router


def test_the_result_records_the_router_in_front():
    args = _args(
        identity="program_id",
        replicas=2,
        routing_policy=["cache_aware", "program"],
        router_arg=["--log-level", "debug"],
        program_scheduling={"global_queue": True},
    )
    fleet = SimpleNamespace(router_args=["--policy", "consistent_hash", "--log-level", "debug"])
    assert run_sweep.router_record(args, "cache_aware", fleet)["program_scheduling"] is None
    record = run_sweep.router_record(args, "program", fleet)
    assert record["router_args"] == fleet.router_args
    assert record["extra_router_args"] == ["--log-level", "debug"]
    assert record["program_scheduling"] == {"global_queue": True}
    assert (record["replicas"], record["routing_policy"], record["identity"]) == (
        2,
        "program",
        "program_id",
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--replicas", "2"],  # job_id: the router would send every job to one replica
        ["--replicas", "2", "--identity", "x-session-id", "--engine", "upstream"],
        ["--replicas", "0"],
        # The Program layer reads vllm_xargs.agentic_context: with the header alone no
        # request would opt in.
        ["--replicas", "2", "--identity", "x-session-id", "--routing-policy", "program"],
        ["--replicas", "2", "--identity", "x-session-id", "--routing-policy", "random", "program"],
        ["--replicas", "2", "--identity", "x-session-id", "--program-config-json", "{}"],
        ["--router-arg=--log-level", "--router-arg=debug"],  # no router before one server
    ],
)
def test_router_points_need_a_router_identity(monkeypatch, tmp_path, argv):
    monkeypatch.setattr("sys.argv", ["run_sweep", "--results-dir", str(tmp_path), *argv])
    with pytest.raises(SystemExit) as info:
        run_sweep.main()
    assert info.value.code == 2 and not any(tmp_path.iterdir())  # refused before any point


def test_routings_and_policies_are_interleaved_at_each_load(monkeypatch, tmp_path):
    calls = []

    def run_point(args, out_dir, policy, jps, routing):
        calls.append((jps, routing, policy))

    monkeypatch.setattr(run_sweep, "run_point", run_point)
    argv = ["--results-dir", str(tmp_path), "--machine", "m", "--replicas", "2"]
    argv += ["--identity", "program_id", "--routing-policy", "round_robin", "program"]
    argv += ["--policies", "fcfs", "continuum", "--jps", "0.04", "0.08"]
    argv += ["--router-arg=--log-level", "--router-arg=debug"]
    monkeypatch.setattr("sys.argv", ["run_sweep", *argv])
    run_sweep.main()
    assert calls[:4] == [
        (0.04, "round_robin", "fcfs"),
        (0.04, "round_robin", "continuum"),
        (0.04, "program", "fcfs"),
        (0.04, "program", "continuum"),
    ]
    assert len(calls) == 8 and calls[4][0] == 0.08
    config = json.loads((tmp_path / "m" / "sweep_config.json").read_text())
    assert config["routing_policy"] == ["round_robin", "program"]
    assert config["router_arg"] == ["--log-level", "debug"]
    assert config["program_scheduling"]["token_capacity_per_dp_rank"] == 400 * 16


def test_a_resumed_sweep_skips_its_own_points_only(monkeypatch, tmp_path, capsys):
    # A point written by another workload (here the fork mix, where the sweep asks the
    # guided one) is not taken for this sweep's: the sweep stops and says why.
    args = run_sweep.make_parser().parse_args(["--tool-mix", "guided", "--duration", "60"])
    started = []
    monkeypatch.setattr(run_sweep, "start_point", lambda *a: started.append(a))
    out = run_sweep.result_path(tmp_path, "continuum", 1.5)
    out.write_text(json.dumps({"tool_mix": "fork", "seed": 0, "duration_s": 60.0}))
    with pytest.raises(SystemExit, match="tool_mix 'fork', not 'guided'"):
        run_sweep.run_point(args, tmp_path, "continuum", 1.5, None)
    out.write_text(json.dumps({"tool_mix": "guided", "seed": 0, "duration_s": 60.0}))
    run_sweep.run_point(args, tmp_path, "continuum", 1.5, None)  # its own: skipped
    assert "skip" in capsys.readouterr().out
    out.write_text(json.dumps({"policy": "continuum"}))  # an older result: nothing to compare
    run_sweep.run_point(args, tmp_path, "continuum", 1.5, None)
    assert started == []
