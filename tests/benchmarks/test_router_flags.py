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
