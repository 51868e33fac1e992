"""The flags ReplicaSet gives vllm-router, without starting it: the routing policy, the fast
failover, the Program layer (``program``) with our config, then the caller's flags."""

from __future__ import annotations

import json

import pytest

from vllm.benchmarks.router import (
    FAST_FAILOVER,
    ROUTING_POLICIES,
    make_parser,
    program_scheduling_config,
    router_flags,
)


def test_a_router_policy_is_passed_as_is_and_the_caller_s_flags_come_last():
    flags = router_flags("cache_aware", ["--cache-threshold", "0.9"])
    assert flags == ["--policy", "cache_aware", *FAST_FAILOVER, "--cache-threshold", "0.9"]


def test_program_is_the_program_layer_over_consistent_hash():
    config = program_scheduling_config(6400, overrides={"binding_only": True})
    flags = router_flags("program", ["--log-level", "debug"], config)
    assert flags[:2] == ["--policy", "consistent_hash"]
    i = flags.index("--enable-program-scheduling")
    assert flags[i + 1] == "--program-scheduling-config-json"
    assert json.loads(flags[i + 2]) == config
    assert flags[-2:] == ["--log-level", "debug"]
    # Omitted, the config is ours without a token capacity.
    default = router_flags("program")
    assert json.loads(default[default.index("--enable-program-scheduling") + 2]) == (
        program_scheduling_config()
    )


def test_our_program_config_opts_in_by_the_agentic_context_and_sizes_by_the_pool():
    config = program_scheduling_config(400 * 16)
    assert config["program_scheduling_enable_key"] == "vllm_xargs.agentic_context"
    assert config["binding_strategy"] == "consistent_hash" and config["global_queue"] is True
    assert config["token_capacity_per_dp_rank"] == 6400
    assert "token_capacity_per_dp_rank" not in program_scheduling_config()
    assert program_scheduling_config(overrides={"global_queue": False})["global_queue"] is False


@pytest.mark.parametrize(
    "policy, config", [("warp", None), ("round_robin", program_scheduling_config())]
)
def test_refused(policy, config):
    with pytest.raises(ValueError):
        router_flags(policy, (), config)


def test_the_launcher_offers_the_router_s_policies_and_program():
    choices = next(a for a in make_parser()._actions if a.dest == "policy").choices
    assert tuple(choices) == (*ROUTING_POLICIES, "program")


def test_replicas_get_their_own_kv_event_sockets():
    from vllm.benchmarks.router import replica_kv_events

    assert replica_kv_events(["--block-size", "32"], 1) == (["--block-size", "32"], None)
    config = '{"enable_kv_cache_events": true, "replay_endpoint": "tcp://*:6000"}'
    for form in (["--kv-events-config", config], [f"--kv-events-config={config}"]):
        args, got = replica_kv_events(["--max-num-seqs", "4", *form], 2)
        assert args[:2] == ["--max-num-seqs", "4"] and args[2] == "--kv-events-config"
        assert json.loads(args[3]) == got  # vLLM's data-parallel rule: port + index
        assert got["endpoint"] == "tcp://*:5559" and got["replay_endpoint"] == "tcp://*:6002"
    # kv_aware without a config of the user's: each replica on Unix sockets of its own
    # (bound: vLLM binds tcp only on a wildcard host, which would reach other machines).
    (_, a), (_, b) = (replica_kv_events([], i, "/run/x") for i in range(2))
    assert a["enable_kv_cache_events"] and a["endpoint"] == "ipc:///run/x/replica0-events"
    assert len({a["endpoint"], b["endpoint"], a["replay_endpoint"], b["replay_endpoint"]}) == 4


@pytest.mark.parametrize(
    "config, socket_dir, match",
    [
        ('{"enable_kv_cache_events": false}', "/run/x", "kv_aware routing needs"),
        ('{"enable_kv_cache_events": true, "topic": "kv"}', "/run/x", "reads no topic"),
        ('{"enable_kv_cache_events": true, "endpoint": "inproc://x"}', None, "tcp:// or ipc://"),
        ("[1]", None, "must be a JSON object"),
    ],
)
def test_kv_event_configs_replicas_cannot_share_are_refused(config, socket_dir, match):
    from vllm.benchmarks.router import replica_kv_events

    with pytest.raises(ValueError, match=match):
        replica_kv_events(["--kv-events-config", config], 1, socket_dir)


def test_kv_aware_routing_subscribes_the_router_to_every_replica():
    from vllm.benchmarks.router import kv_event_sources

    replicas = [
        ("http://127.0.0.1:1", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5600"),
        ("http://127.0.0.1:2", "tcp://127.0.0.1:5558", None),
    ]
    assert kv_event_sources(replicas, "m", 32) == [
        "--kv-event-model", "m", "--kv-event-block-size", "32",
        "--kv-event-source", "http://127.0.0.1:1=tcp://127.0.0.1:5557",
        "--kv-event-replay-source", "http://127.0.0.1:1=tcp://127.0.0.1:5600",
        "--kv-event-source", "http://127.0.0.1:2=tcp://127.0.0.1:5558",
    ]  # fmt: skip


def test_a_forwarder_republishes_a_unix_socket_on_loopback_tcp(tmp_path):
    """vllm-router reads TCP sources only; a replica's events on a Unix socket reach it
    through an EventForwarder (subscriptions go upstream, batches come down)."""
    import time

    import zmq

    from vllm.benchmarks.router import EventForwarder
    from vllm.distributed.kv_events import KVEventLog, ZmqEventPublisher

    options = {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/events", "replay_endpoint": None,
        "buffer_steps": 10, "hwm": 1000, "max_queue_size": 10, "topic": "",
    }  # fmt: skip
    publisher = ZmqEventPublisher(options)
    forwarder = EventForwarder(options["endpoint"])
    ctx = zmq.Context()
    try:
        assert forwarder.endpoint.startswith("tcp://127.0.0.1:")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.connect(forwarder.endpoint)
        log = KVEventLog()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the subscription has travelled up
            log.stored([b"\x07" * 32], None, [1, 2], 2, "GPU")
            publisher.publish(log.take())
            try:
                topic, seq, payload = sub.recv_multipart()
                break
            except zmq.Again:
                continue
        else:
            raise AssertionError("nothing came through the forwarder")
        assert topic == b"" and len(seq) == 8 and b"BlockStored" in payload
    finally:
        forwarder.stop()
        publisher.shutdown()
        ctx.destroy(linger=0)
    assert not forwarder._thread.is_alive()


# -- disaggregated prefill (--pd): producers, consumers, the router's P/D mode --------------


def test_pd_counts_are_prefill_colon_decode():
    from vllm.benchmarks.router import parse_pd

    assert parse_pd("1:1") == (1, 1) and parse_pd("2:3") == (2, 3)
    for bad in ("2", "0:1", "1:0", "a:b", "1:2:3", ""):
        with pytest.raises(ValueError, match="PREFILL:DECODE"):
            parse_pd(bad)


def test_each_side_gets_a_kv_transfer_config_of_its_role():
    from vllm.benchmarks.router import pd_serve_args

    serve = ["--num-gpu-blocks-override", "128"]
    for role in ("kv_producer", "kv_consumer"):
        args = pd_serve_args(serve, role)
        assert args[:2] == serve and args[2] == "--kv-transfer-config"
        assert json.loads(args[3]) == {"kv_connector": "TcpConnector", "kv_role": role}
    # The user's config keeps its keys; a fixed block-server port is per producer.
    config = (
        '{"kv_connector": "NixlConnector", "kv_port": 7000, "kv_load_failure_policy": "recompute"}'
    )
    for form in (["--kv-transfer-config", config], [f"--kv-transfer-config={config}"]):
        got = json.loads(pd_serve_args(form, "kv_producer", 2)[1])
        assert got == {
            "kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_port": 7002,
            "kv_load_failure_policy": "recompute",
        }  # fmt: skip
        assert json.loads(pd_serve_args(form, "kv_consumer", 2)[1])["kv_port"] == 7000


@pytest.mark.parametrize(
    "args, role, match",
    [
        (["--kv-transfer-config", '{"kv_role": "kv_both"}'], "kv_producer", "sets each"),
        (["--kv-transfer-config", "[1]"], "kv_consumer", "must be a JSON object"),
        ([], "kv_both", "role must be"),
    ],
)
def test_pd_serve_args_refused(args, role, match):
    from vllm.benchmarks.router import pd_serve_args

    with pytest.raises(ValueError, match=match):
        pd_serve_args(args, role)


def test_the_router_runs_vllm_s_pd_mode_over_both_groups():
    from vllm.benchmarks.router import pd_worker_flags

    flags = pd_worker_flags(["http://p0", "http://p1"], ["http://d0"])
    assert flags == [
        "--vllm-pd-disaggregation", "--kv-connector", "nixl",
        "--prefill", "http://p0", "--prefill", "http://p1", "--decode", "http://d0",
    ]  # fmt: skip
    # What vllm-router 0.1.17's own parser makes of them.
    pytest.importorskip("vllm_router")
    from vllm_router.router_args import RouterArgs

    parser = __import__("argparse").ArgumentParser()
    RouterArgs.add_cli_args(parser)
    parsed = RouterArgs.from_cli_args(parser.parse_args([*flags, *router_flags("round_robin")]))
    assert parsed.vllm_pd_disaggregation and parsed.kv_connector == "nixl"
    assert parsed.prefill_urls == [("http://p0", None), ("http://p1", None)]
    assert parsed.decode_urls == ["http://d0"] and parsed.policy == "round_robin"


@pytest.mark.parametrize(
    "counts, policy, match",
    [((0, 1), "consistent_hash", "a producer and a consumer"), ((1, 1), "program", "policy"),
     ((1, 1), "kv_aware", "policy")],
)  # fmt: skip
def test_pd_fleets_refused_before_anything_starts(counts, policy, match):
    from vllm.benchmarks.router import PDSet

    with pytest.raises(ValueError, match=match):
        PDSet(*counts, policy=policy)


def test_the_launcher_s_pd_flag(capsys):
    from vllm.benchmarks.router import main

    assert make_parser().parse_args(["--pd", "2:1"]).pd == "2:1"
    assert make_parser().parse_args([]).pd is None  # --replicas mode by default
    for argv, match in (
        (["--pd", "1"], "PREFILL:DECODE"),
        (["--pd", "1:1", "--policy", "program"], "--pd takes --policy"),
    ):
        with pytest.raises(SystemExit):
            main([*argv, "--", "--num-gpu-blocks-override", "8"])
        assert match in capsys.readouterr().err
