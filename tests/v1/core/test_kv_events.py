"""KV cache events (--kv-events-config): replaying them gives exactly the hashes each
medium holds, and each BlockStored names the tokens and parent its hashes chain from."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
)
from vllm.lora.request import LoRARequest
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import hash_block_tokens

from .conftest import apply_random_op, make_request

BS = 4


class Replay:
    """A subscriber's view: the hashes each medium holds, from the events alone."""

    def __init__(self) -> None:
        self.held: dict[str, set] = {"GPU": set(), "CPU": set()}
        self.stored: list[BlockStored] = []

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                new = set(event.block_hashes)
                assert not new & self.held[event.medium], "stored a hash already held"
                self.held[event.medium] |= new
                self.stored.append(event)
            elif isinstance(event, BlockRemoved):
                gone = set(event.block_hashes)
                assert gone <= self.held[event.medium], "removed a hash not held"
                self.held[event.medium] -= gone
            else:
                assert isinstance(event, AllBlocksCleared)
                for held in self.held.values():
                    held.clear()


def held_by_pools(m: KVCacheManager, log: KVEventLog) -> dict[str, set]:
    gpu = {log.external(b.block_hash) for b in m.block_pool.blocks if b.block_hash is not None}
    cpu = set() if m.offload is None else {log.external(h) for h in m.offload.pool._hash_to_id}
    return {"GPU": gpu, "CPU": cpu}


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "step", "free", "offload", "reset"]), st.integers(0, 30)
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.sampled_from([0, 3]), st.booleans())
def test_replayed_events_are_the_pools_hashes(seq, num_cpu_blocks, int_hashes):
    """After every operation (as after every step), a subscriber that applied the events
    holds exactly the hashes of the KV cache and of the tier; no event stores a hash the
    medium already holds or removes one it does not."""
    import os

    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if int_hashes else "0"
    try:
        log = KVEventLog()
    finally:
        del os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"]
    m = KVCacheManager(9, BS, 64, num_cpu_blocks=num_cpu_blocks, kv_events=log)
    replay, live = Replay(), []
    for op, arg in seq:
        apply_random_op(m, live, op, arg, BS)
        m.take_kv_transfers()  # the step's end: the tier's held blocks are released
        replay.apply(log.take())
        assert replay.held == held_by_pools(m, log)
        m.check_invariants()
    # Every BlockStored of the KV cache names the tokens its hashes chain from.
    for event in replay.stored:
        if event.medium == "CPU":
            assert event.token_ids == [] and event.block_size == 0  # vLLM's placeholder
            continue
        assert len(event.token_ids) == BS * len(event.block_hashes) and event.block_size == BS
        if not int_hashes:
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                parent = hash_block_tokens(parent, event.token_ids[i * BS : (i + 1) * BS])
                assert parent == block_hash


def test_stored_event_carries_the_request_its_lora_salt_and_job():
    log = KVEventLog()
    m = KVCacheManager(20, BS, 64, kv_events=log)
    lora = LoRARequest("sql", 3, "/x")
    req = make_request(
        list(range(10)), block_size=BS, job_id="agent-7", cache_salt="tenant", lora_request=lora
    )
    assert m.allocate_slots(req, 10) is not None
    (event,) = log.take()
    assert isinstance(event, BlockStored)
    assert event.token_ids == list(range(8))  # the two full blocks; 2 tokens left over
    assert event.parent_block_hash is None and event.block_size == BS
    assert event.block_hashes == [log.external(h) for h in req.block_hashes[:2]]
    assert (event.lora_id, event.lora_name, event.session_id) == (3, "sql", "agent-7")
    assert event.extra_keys == [("sql", "tenant"), None] and event.medium == "GPU"
    # Decoding fills the third block: a new event, chained to the second.
    for t in (10, 11):
        req.append_output_token_ids(t)
        req.num_computed_tokens = req.num_tokens - 1
        assert m.allocate_slots(req, 1) is not None
    req.num_computed_tokens = req.num_tokens
    (event,) = log.take()
    assert event.parent_block_hash == log.external(req.block_hashes[1])
    assert event.token_ids == [8, 9, 10, 11] and event.extra_keys is None


def test_a_second_copy_of_a_hash_is_not_news_and_its_removal_waits_for_the_last():
    """Two requests computing one prefix side by side each hold a copy of its blocks: the
    hash is stored once and removed only when the last copy is evicted."""
    log = KVEventLog()
    m = KVCacheManager(5, BS, 64, kv_events=log)  # 4 usable blocks
    a, b = (make_request(list(range(8)), block_size=BS) for _ in range(2))
    assert m.allocate_slots(a, 5) is not None and m.allocate_slots(b, 5) is not None
    events = log.take()
    assert [type(e) for e in events] == [BlockStored]  # b's copy: no event
    m.free(a)
    m.free(b)
    c = make_request(list(range(100, 108)), block_size=BS)
    assert m.allocate_slots(c, 5) is not None  # evicts both copies
    removed = [e for e in log.take() if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == 1


def test_reset_is_all_blocks_cleared_and_a_refused_one_records_nothing():
    log = KVEventLog()
    m = KVCacheManager(9, BS, 64, num_cpu_blocks=4, kv_events=log)
    req = make_request(list(range(9)), block_size=BS)
    assert m.allocate_slots(req, 9) is not None
    req.num_computed_tokens = 9
    log.take()
    assert not m.reset_prefix_cache()  # a request holds blocks
    assert log.take() == []
    m.free(req, offload=True)
    assert [e.medium for e in log.take()] == ["CPU", "CPU"]  # the two full blocks saved
    m.take_kv_transfers()
    assert m.reset_prefix_cache()
    assert log.take() == [AllBlocksCleared()]


def test_batch_wire_format_is_vllms():
    """The payload subscribers decode: an array [ts, events, rank]; each event a map
    tagged with its class name; optional fields left out when unset."""
    log = KVEventLog()
    log.stored([b"\x01" * 32], None, [1, 2], 2, "GPU")
    log.removed(b"\x02" * 32, "CPU")
    log.cleared()
    batch = KVEventBatch(ts=1.5, events=log.take(), data_parallel_rank=0)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    low64 = int.from_bytes(b"\x01" * 8, "big")
    assert raw == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [low64],
                "parent_block_hash": None,
                "token_ids": [1, 2],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            },
            {
                "type": "BlockRemoved",
                "block_hashes": [int.from_bytes(b"\x02" * 8, "big")],
                "medium": "CPU",
                "group_idx": 0,
            },
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert decoded == batch


@pytest.mark.parametrize("value", ["0", "1"])
def test_block_hash_naming_follows_vllms_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", value)
    digest = bytes(range(32))
    named = KVEventLog().external(digest)
    assert named == (digest if value == "0" else int.from_bytes(digest[-8:], "big"))
