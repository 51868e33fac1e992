"""--kv-events-config (vLLM's): its checks, the ZeroMQ publisher and its replay socket,
and a served engine's events: the blocks of a prompt, named with its tokens and job."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq

from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import END_SEQ, KVEventBatch, KVEventLog, ZmqEventPublisher
from vllm.entrypoints.utils import get_open_port

DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@pytest.mark.parametrize(
    "spec, name",
    [
        ({"enable_kv_cache_events": "yes"}, "kv_events_config.enable_kv_cache_events"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "kv_events_config.publisher"),
        ({"enable_kv_cache_events": True, "endpoint": "localhost:5557"},
         "kv_events_config.endpoint"),
        ({"enable_kv_cache_events": True, "replay_endpoint": 5558},
         "kv_events_config.replay_endpoint"),
        ({"enable_kv_cache_events": True, "buffer_steps": 0}, "kv_events_config.buffer_steps"),
        ({"enable_kv_cache_events": True, "hwm": -1}, "kv_events_config.hwm"),
        ({"enable_kv_cache_events": True, "topic": 3}, "kv_events_config.topic"),
        ({"enable_kv_cache_events": True, "medium": "GPU"}, "kv_events_config"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_naming_the_key(spec, name):
    with pytest.raises(ValueError, match=name):
        KVEventsConfig(spec)


def test_events_are_on_only_with_the_switch_and_a_zmq_publisher():
    assert not KVEventsConfig().enabled
    assert KVEventsConfig({"enable_kv_cache_events": True}).options["publisher"] == "zmq"
    assert KVEventsConfig({"enable_kv_cache_events": True}).enabled
    assert not KVEventsConfig({"enable_kv_cache_events": True, "publisher": "null"}).enabled
    assert not KVEventsConfig({"publisher": "zmq"}).enabled  # vLLM: the switch is off


def test_events_need_prefix_caching():
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        kv_events_config='{"enable_kv_cache_events": true}', enable_prefix_caching=False
    )
    with pytest.raises(ValueError, match="--kv-events-config needs prefix caching"):
        args.create_engine_config()


def options(**extra) -> dict:
    return {**KVEventsConfig({"enable_kv_cache_events": True}).options, **extra}


def subscriber(ctx: zmq.Context, endpoint: str, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.connect(endpoint)
    return sub


def test_publisher_sends_numbered_batches_and_replays_them():
    port, replay_port = get_open_port(), get_open_port()
    publisher = ZmqEventPublisher(
        options(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv")
    )
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, f"tcp://127.0.0.1:{port}", b"kv")
        time.sleep(0.5)  # the subscription reaches the publisher (ZeroMQ's slow joiner)
        log = KVEventLog()
        for i in range(3):
            log.stored([bytes([i]) * 32], None, [i] * 4, 4, "GPU")
            publisher.publish(log.take())
        received = [sub.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(seq, "big") for _, seq, _ in received] == [0, 1, 2]
        assert {topic for topic, _, _ in received} == {b"kv"}
        batches = [DECODER.decode(payload) for _, _, payload in received]
        assert [b.events[0].token_ids for b in batches] == [[0] * 4, [1] * 4, [2] * 4]
        assert {b.data_parallel_rank for b in batches} == {0}
        # A subscriber that missed batches asks for them from a sequence number on (a
        # DEALER, so that it can read every reply; the empty frame is REQ's envelope).
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))
        replayed = []
        while True:
            empty, *frames = dealer.recv_multipart()
            assert empty == b""
            if frames[1] == END_SEQ:
                break
            replayed.append(frames)
        assert replayed == received[1:]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
    assert not publisher._thread.is_alive()


def test_an_endpoint_in_use_is_a_clear_error():
    port = get_open_port()
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    taken.bind(f"tcp://*:{port}")
    try:
        with pytest.raises(ValueError, match=f"kv_events_config.endpoint 'tcp://\\*:{port}'"):
            ZmqEventPublisher(options(endpoint=f"tcp://*:{port}"))
    finally:
        ctx.destroy(linger=0)


def test_a_full_queue_drops_batches_instead_of_stalling_the_engine():
    publisher = ZmqEventPublisher(options(endpoint="inproc://kv-full", max_queue_size=1))
    try:
        publisher._queue.put(None)  # the thread stops at this: nothing drains the queue
        publisher._thread.join(5)
        started = time.monotonic()
        for _ in range(5):
            publisher.publish([])  # the first fills the queue
        assert publisher.num_dropped == 4 and time.monotonic() - started < 1.0
    finally:
        publisher.shutdown()


@pytest.mark.slow
def test_a_served_prompt_is_published_as_its_blocks(tmp_path):
    """`vllm serve --kv-events-config`: a completion's full prompt blocks arrive as
    BlockStored with the prompt's tokens and the request's job; a prefix-cache reset
    (dev mode) as AllBlocksCleared."""
    import requests

    from tests.entrypoints.test_generation_config import tiny_model
    from tests.utils import RemoteServer

    model = tiny_model(tmp_path / "tiny")
    port = get_open_port()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv"}
    ctx = zmq.Context()
    sub = subscriber(ctx, f"tcp://127.0.0.1:{port}", b"kv")
    server = RemoteServer(
        "--model", model, "--block-size", "16", "--kv-events-config", json.dumps(config),
        log_path=str(tmp_path / "server.log"), env={"VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    try:
        prompt = "The tide came in over the flats while the gulls argued about the light. " * 4
        ids = requests.post(
            server.base + "/tokenize", json={"model": model, "prompt": prompt}
        ).json()["tokens"]
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "job_id": "agent-1"}
        assert requests.post(server.base + "/v1/completions", json=body).ok
        stored = []
        while sum(len(e.token_ids) for e in stored) < len(ids) // 16 * 16:
            _, _, payload = sub.recv_multipart()
            stored += DECODER.decode(payload).events
        assert [e.medium for e in stored] == ["GPU"] * len(stored)
        assert [t for e in stored for t in e.token_ids] == ids[: len(ids) // 16 * 16]
        assert {e.session_id for e in stored} == {"agent-1"}
        assert requests.post(server.base + "/reset_prefix_cache").json() == {"success": True}
        events = []
        while not events or type(events[-1]).__name__ != "AllBlocksCleared":
            events += DECODER.decode(sub.recv_multipart()[2]).events
    finally:
        server.stop()
        ctx.destroy(linger=0)
