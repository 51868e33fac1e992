"""Disaggregated prefill (--kv-transfer-config): the config's checks, the wire, and two
engines of the embedded model in one process, a producer and a consumer, whose decode
from fetched blocks gives the tokens of a plain engine."""

from __future__ import annotations

import socket

import pytest
import torch
import zmq

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.connector import check_transfer_params
from vllm.distributed.kv_transfer.transport import (
    KVBlockServer,
    TransferError,
    frames_tensors,
    request_blocks,
    tensor_frames,
)

PRODUCER = {"kv_connector": "TcpConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "TcpConnector", "kv_role": "kv_consumer"}


# -- the config ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, "kv_connector"),
        ({"kv_connector": "TcpConnector"}, "kv_role"),
        ({"kv_connector": "TcpConnector", "kv_role": "both"}, "kv_role"),
        ({**PRODUCER, "kv_port": 70000}, "kv_port"),
        ({**PRODUCER, "kv_load_failure_policy": "retry"}, "kv_load_failure_policy"),
        ({**PRODUCER, "kv_buffer_size": 1e9}, "kv_transfer_config"),
        ({**PRODUCER, "kv_connector_module_path": "my.mod"}, "kv_connector_module_path"),
        ({**PRODUCER, "kv_connector_extra_config": {"abort_timeout_s": 0}}, "abort_timeout_s"),
        ({**PRODUCER, "kv_connector_extra_config": {"lease": 1}}, "kv_connector_extra_config"),
    ],
)
def test_bad_configs_name_their_key(spec, named):
    with pytest.raises(ValueError, match=named):
        KVTransferConfig(kv_transfer_config=spec)


def test_defaults_and_roles():
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}  # vLLM's name, accepted
    both = KVTransferConfig(kv_transfer_config=nixl)
    assert both.is_producer and both.is_consumer
    opts = both.options
    assert (opts["kv_ip"], opts["kv_port"]) == ("127.0.0.1", 0)
    assert opts["kv_load_failure_policy"] == "fail"  # vLLM's default
    assert opts["abort_timeout_s"] == 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT
    producer = KVTransferConfig(kv_transfer_config=PRODUCER)
    assert producer.is_producer and not producer.is_consumer
    assert not KVTransferConfig().enabled


def test_needs_prefix_caching():
    from vllm.config import CacheConfig

    with pytest.raises(ValueError, match="prefix caching"):
        VllmConfig(
            cache_config=CacheConfig(enable_prefix_caching=False),
            kv_transfer_config=KVTransferConfig(kv_transfer_config=PRODUCER),
        )


@pytest.mark.parametrize(
    ("params", "producer", "consumer", "named"),
    [
        ({"do_remote_decode": True}, False, False, "no --kv-transfer-config"),
        ({"do_remote_decode": True}, False, True, "do_remote_decode"),
        (
            {
                "do_remote_prefill": True,
                "remote_host": "h",
                "remote_port": 1,
                "remote_request_id": "r",
            },
            True,
            False,
            "do_remote_prefill",
        ),  # fmt: skip
        (
            {"do_remote_prefill": True, "remote_port": 1, "remote_request_id": "r"},
            True,
            True,
            "remote_host",
        ),  # fmt: skip
        (
            {
                "do_remote_prefill": True,
                "remote_host": "h",
                "remote_port": "1",
                "remote_request_id": "r",
            },
            True,
            True,
            "remote_port",
        ),  # fmt: skip
        ({"do_remote_decode": "yes"}, True, True, "do_remote_decode"),
    ],
)
def test_request_params_checked(params, producer, consumer, named):
    with pytest.raises(ValueError, match=named):
        check_transfer_params(params, producer, consumer)


def test_router_nulls_pass():
    # vllm-router's prefill request: do_remote_decode with the consumer's keys null.
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    check_transfer_params(params, producer=True, consumer=False)
    check_transfer_params({}, producer=False, consumer=False)


# -- the wire --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frames_round_trip(dtype):
    layers = [torch.randn(2, 3, 4, 2, 8).to(dtype), torch.randn(1, 3, 4, 1, 16).to(dtype)]
    layouts, frames = tensor_frames(layers)
    back = frames_tensors(layouts, [bytes(f) for f in frames])
    for a, b in zip(layers, back, strict=True):
        assert b.dtype == dtype and torch.equal(a, b)
    with pytest.raises(TransferError, match="bytes"):
        frames_tensors(layouts, [bytes(frames[0])[:-2], bytes(frames[1])])


def test_a_data_parallel_rank_serves_on_its_own_port(monkeypatch):
    from vllm.entrypoints.utils import get_open_port

    port = get_open_port()
    monkeypatch.setenv("VLLM_DP_RANK", "1")  # as dp_client.py starts rank 1's engine
    spec = {**PRODUCER, "kv_port": port - 1, "engine_id": "prefill"}
    producer = LLM(kv_transfer_config=spec, **KW)
    try:
        params = prefill(producer, ROME)
        # kv_port + rank, so two ranks on one host do not collide (vLLM's rule)
        assert params["remote_port"] == port and params["remote_engine_id"] == "prefill_dp1"
    finally:
        producer.engine_core.shutdown()


def test_server_answers_and_refuses():
    ctx = zmq.Context()
    data = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4)

    sent = []

    def serve(header):
        if header["request_id"] == "bad":
            raise TransferError("no such request")
        ids = torch.tensor(header["ids"])
        return {"num_blocks": len(ids)}, [data.index_select(1, ids)], lambda: sent.append(1)

    server = KVBlockServer(ctx, "127.0.0.1", 0, serve)
    try:
        reply, (layer,) = request_blocks(
            ctx, "127.0.0.1", server.port, {"request_id": "r", "ids": [4, 1]}, 5.0
        )
        assert reply["num_blocks"] == 2 and torch.equal(layer, data[:, [4, 1]])
        assert sent == [1]  # told once the frames left
        with pytest.raises(TransferError, match="no such request"):
            request_blocks(ctx, "127.0.0.1", server.port, {"request_id": "bad"}, 5.0)
        with pytest.raises(ValueError, match="kv_port"):  # the port is taken
            KVBlockServer(ctx, "127.0.0.1", server.port, serve)
    finally:
        server.close()
        ctx.destroy(linger=0)


def test_fetch_from_nowhere_times_out():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    ctx = zmq.Context()
    try:
        with pytest.raises(TransferError, match="no answer"):
            request_blocks(ctx, "127.0.0.1", port, {"op": "fetch"}, 0.3)
    finally:
        ctx.destroy(linger=0)


def test_tier_views_and_runs_copy_blocks_exactly():
    from vllm.v1.kv_offload.worker import CPUOffloadingHandler

    caches = [torch.randn(2, 8, 4, 2, 8), torch.randn(2, 8, 4, 2, 8)]
    src = CPUOffloadingHandler(caches, num_blocks=12)
    dst = CPUOffloadingHandler([c.clone() for c in caches], num_blocks=12)
    for t in src.cpu_caches:
        t.copy_(torch.randn_like(t))
    ids = [3, 4, 5, 9, 10]  # two runs
    runs, views = src.block_views(ids)
    assert runs == [3, 2] and len(views) == 2 * 2 * 2  # layers x K/V x runs
    assert all(v.is_contiguous() for v in views)
    base = src.cpu_caches[0].untyped_storage().data_ptr()
    assert views[0].untyped_storage().data_ptr() == base  # views, not copies
    chunks = [views[i * 2 : i * 2 + 2] for i in range(4)]
    # rows 0-2 of run 0 -> tier blocks 0-2; rows 0-1 of run 1 -> blocks 7-8
    dst.write_runs([(0, 0, 0, 3), (1, 0, 7, 2)], chunks)
    for s, d in zip(src.cpu_caches, dst.cpu_caches, strict=True):
        assert torch.equal(d[:, 0:3], s[:, 3:6]) and torch.equal(d[:, 7:9], s[:, 9:11])


# -- two engines -----------------------------------------------------------------------------
ROME = (
    "The history of the Roman Empire, from the founding of the city on the seven hills to "
    "the fall of Constantinople in 1453, is long, violent and full of surprises, and "
    "historians still argue about its causes. Its first emperor was"
)
MORE = " Augustus, who ruled for forty years. After him came Tiberius, and then"
OTHER = "Carthage was the other great power of the western Mediterranean. " + ROME
KW = {"max_model_len": 512, "quantization": "fp32", "num_gpu_blocks_override": 64}


def greedy(n: int = 10, **transfer) -> SamplingParams:
    extra = {"kv_transfer_params": transfer} if transfer else None
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


@pytest.fixture(scope="module")
def engines():
    extra = {"kv_connector_extra_config": {"fetch_timeout_s": 5}}
    producer = LLM(kv_transfer_config=PRODUCER, **KW)
    consumer = LLM(kv_transfer_config={**CONSUMER, **extra}, **KW)
    plain = LLM(**KW)
    yield producer, consumer, plain
    for llm in (producer, consumer, plain):
        llm.engine_core.shutdown()


def prefill(producer: LLM, prompt: str) -> dict:
    out = producer.generate(prompt, greedy(1, do_remote_decode=True))[0]
    assert out.outputs[0].finish_reason == "length"
    return out.kv_transfer_params


def held(llm: LLM) -> int:
    return llm.engine_core.scheduler.kv_cache_manager.offload.pool.num_held_blocks


@pytest.mark.slow
def test_decode_from_fetched_blocks_matches_a_plain_engine(engines):
    producer, consumer, plain = engines
    connector = consumer.engine_core.kv_connector
    bs = 16
    params = prefill(producer, ROME)
    n_prompt = len(producer.get_tokenizer().encode(ROME))
    full = (n_prompt - 1) // bs
    assert params["do_remote_prefill"] is True and params["remote_port"] > 0
    assert params["remote_num_tokens"] >= full * bs
    assert held(producer) == len(params["remote_block_ids"])
    before = connector.totals().blocks_received
    out = consumer.generate(ROME, greedy(**params))[0]
    assert out.outputs[0].token_ids == plain.generate(ROME, greedy())[0].outputs[0].token_ids
    assert out.num_cached_tokens == full * bs  # every block but the last token's came over
    assert connector.totals().blocks_received - before == full
    assert held(consumer) == 0  # its hold ended once the request was scheduled
    producer.engine_core.step()  # the producer's loop takes the served hold back
    assert held(producer) == 0 and not producer.engine_core.kv_connector._holds

    # The job's next turn: the consumer still has the first turn's blocks (prefix cache),
    # so only the new ones travel.
    params2 = prefill(producer, ROME + MORE)
    before = connector.totals().blocks_received
    out2 = consumer.generate(ROME + MORE, greedy(**params2))[0]
    expected = plain.generate(ROME + MORE, greedy())[0].outputs[0].token_ids
    assert out2.outputs[0].token_ids == expected
    n2 = len(producer.get_tokenizer().encode(ROME + MORE))
    assert connector.totals().blocks_received - before == (n2 - 1) // bs - full
    producer.engine_core.step()
    assert held(producer) == 0


@pytest.mark.slow
def test_a_failed_fetch_fails_the_request_or_recomputes(engines):
    producer, consumer, plain = engines
    params = prefill(producer, OTHER)
    bogus = {**params, "remote_request_id": "nobody"}  # the producer refuses: unknown id
    failed = consumer.generate(OTHER, greedy(**bogus))[0]  # offline: finished
    assert failed.outputs[0].finish_reason == "error" and not failed.outputs[0].token_ids
    assert held(consumer) == 0 and consumer.engine_core.kv_connector.num_fetching == 0
    # "recompute": the request computes its prompt instead.
    connector = consumer.engine_core.kv_connector
    connector.fail_on_error = False
    try:
        out = consumer.generate(OTHER, greedy(**bogus))[0]
    finally:
        connector.fail_on_error = True
    expected = plain.generate(OTHER, greedy())[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == expected
    # The real hold is still there, until its fetch (or its expiry).
    assert held(producer) > 0
    consumer.generate(OTHER, greedy(**params))
    producer.engine_core.step()
    assert held(producer) == 0


@pytest.mark.slow
def test_an_unfetched_hold_expires(engines):
    producer, _, _ = engines
    connector = producer.engine_core.kv_connector
    prefill(producer, "Expiring. " + ROME)
    assert held(producer) > 0
    for hold in connector._holds.values():
        hold.expires = 0.0
    producer.engine_core.step()
    assert held(producer) == 0 and connector.totals().expired_holds >= 1


@pytest.mark.slow
def test_params_without_a_connector_are_refused(engines):
    _, consumer, plain = engines
    with pytest.raises(ValueError, match="no --kv-transfer-config"):
        plain.generate(ROME, greedy(1, do_remote_decode=True))
    with pytest.raises(ValueError, match="kv_consumer"):
        consumer.generate(ROME, greedy(1, do_remote_decode=True))


def test_one_sequence_per_transfer():
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(n=2, extra_args={"kv_transfer_params": {"do_remote_decode": True}})


@pytest.mark.slow
def test_a_consumer_woken_from_sleep_fetches_into_its_new_tier(engines):
    producer, _, plain = engines
    consumer = LLM(kv_transfer_config=CONSUMER, enable_sleep_mode=True, **KW)
    try:
        consumer.sleep(level=1)  # the KV cache and the tier are released
        consumer.wake_up()  # new ones
        params = prefill(producer, ROME)
        out = consumer.generate(ROME, greedy(**params))[0]
        assert out.outputs[0].token_ids == plain.generate(ROME, greedy())[0].outputs[0].token_ids
        assert out.num_cached_tokens > 0
    finally:
        consumer.engine_core.shutdown()
        producer.engine_core.step()


@pytest.mark.slow
def test_a_prompt_the_cache_cannot_hold_is_refused_before_fetching(engines):
    producer, _, _ = engines
    small = LLM(kv_transfer_config=CONSUMER, max_model_len=512, quantization="fp32",
                num_gpu_blocks_override=4)  # fmt: skip
    try:
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                  "remote_request_id": "r"}  # fmt: skip
        with pytest.raises(ValueError, match="KV cache holds"):
            small.generate(ROME, greedy(**params))
        assert small.engine_core.kv_connector.num_fetching == 0
    finally:
        small.engine_core.shutdown()


@pytest.mark.slow
def test_a_request_aborted_while_fetching_leaves_nothing(engines):
    import threading
    import time

    from vllm.v1.engine import EngineCoreRequest

    producer, consumer, _ = engines
    core = consumer.engine_core
    params = prefill(producer, "Aborted. " + ROME)
    gate = threading.Event()
    fetch = core.kv_connector._fetch

    def slow_fetch(f):  # the blocks are on their way while the abort comes
        gate.wait(10)
        fetch(f)

    core.kv_connector._fetch = slow_fetch
    try:
        ids = producer.get_tokenizer().encode("Aborted. " + ROME)
        sp = greedy(**params)
        core.add_request(EngineCoreRequest("aborted", ids, sp))
        assert core.kv_connector.num_fetching == 1 and core.has_unfinished_requests()
        core.abort_requests(["aborted"])
        assert core.kv_connector.num_fetching == 0 and not core.has_unfinished_requests()
        gate.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and core.kv_connector._arrived.empty():
            time.sleep(0.05)
        core.step()  # the arrival is dropped: no hold, nothing queued
        assert held(consumer) == 0 and "aborted" not in core.scheduler.requests
        assert core.scheduler.kv_cache_manager.num_requests == 0
    finally:
        core.kv_connector._fetch = fetch
        gate.set()
    producer.engine_core.step()  # the fetch was served: the producer's hold ends too
    assert held(producer) == 0
