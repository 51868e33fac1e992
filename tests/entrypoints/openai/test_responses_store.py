"""The Responses API store: the in-memory ``ResponseStore`` and the SQLite-backed
``SharedResponseStore`` pass the same behavioural tests; the shared one is then tested
across instances on one file and across processes writing to it at once."""

from __future__ import annotations

import json
import logging
import multiprocessing
from collections.abc import Callable

import pytest

from vllm.entrypoints.openai.responses_store import (
    ResponseStore,
    SharedResponseStore,
    StoredResponse,
)

AnyStore = ResponseStore | SharedResponseStore
MakeStore = Callable[..., AnyStore]


def entry(rid: str, previous: str | None = None, size: int = 0) -> StoredResponse:
    body = {"id": rid, "previous_response_id": previous, "output": [], "pad": "x" * size}
    return StoredResponse(body, [{"type": "message", "role": "user", "content": rid}], "job")


def json_size(e: StoredResponse) -> int:
    return len(json.dumps([e.response, e.input_items], ensure_ascii=False))


def lru_order(store: AnyStore) -> list[tuple[str, int]]:
    """(id, nbytes) of every entry, least recently used first, read without marking any
    as used (a ``get`` would)."""
    if isinstance(store, ResponseStore):
        return [(e.id, e.nbytes) for e in store._entries.values()]
    return store._conn.execute("SELECT id, nbytes FROM responses ORDER BY used").fetchall()


def ids(store: AnyStore) -> list[str]:
    return [rid for rid, _ in lru_order(store)]


def check_invariants(store: AnyStore) -> None:
    rows = lru_order(store)
    assert len(store) == len(rows) <= store.max_responses
    assert store.nbytes == sum(n for _, n in rows) <= store.max_bytes


@pytest.fixture(params=["memory", "shared"])
def make_store(request, tmp_path):
    """A factory of stores of the parametrized kind; shared ones all on one file."""
    opened: list[SharedResponseStore] = []

    def make(max_responses: int = 100, max_bytes: int = 100_000) -> AnyStore:
        if request.param == "memory":
            return ResponseStore(max_responses, max_bytes)
        store = SharedResponseStore(str(tmp_path / "responses.db"), max_responses, max_bytes)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


# -- both stores --------------------------------------------------------------------------
def test_bounds_must_be_positive(make_store: MakeStore):
    for bounds in ((0, 10), (10, 0), (-1, -1)):
        with pytest.raises(ValueError, match="bounds must be positive"):
            make_store(*bounds)


def test_put_get_delete(make_store: MakeStore):
    store = make_store()
    a = entry("a")
    assert store.put(a) and a.nbytes == json_size(a)
    got = store.get("a")
    assert got is not None
    assert (got.response, got.input_items, got.job_id, got.nbytes) == (
        a.response,
        a.input_items,
        a.job_id,
        a.nbytes,
    )
    assert store.get("nope") is None and len(store) == 1 and store.nbytes == a.nbytes
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    assert len(store) == 0 and store.nbytes == 0
    check_invariants(store)


def test_put_of_a_stored_id_replaces_it_as_the_most_recent(make_store: MakeStore):
    store = make_store(max_responses=2)
    store.put(entry("a", size=10))
    store.put(entry("b"))
    big_a = entry("a", size=500)
    store.put(big_a)
    assert ids(store) == ["b", "a"] and store.nbytes == big_a.nbytes + store.get("b").nbytes
    assert store.get("a").response["pad"] == "x" * 500
    check_invariants(store)


def test_lru_eviction_by_count(make_store: MakeStore):
    store = make_store(max_responses=2)
    store.put(entry("a"))
    store.put(entry("b"))
    assert store.get("a") is not None  # a is now the most recent: b goes first
    store.put(entry("c"))
    assert ids(store) == ["a", "c"]
    check_invariants(store)


def test_lru_eviction_by_bytes(make_store: MakeStore):
    # Three entries of ~1,100 bytes each: any two fit in 2,500 bytes, three do not.
    store = make_store(max_bytes=2_500)
    for rid in "abc":
        assert store.put(entry(rid, size=1_000))
    assert ids(store) == ["b", "c"]
    store.get("b")
    store.put(entry("d", size=1_000))
    assert ids(store) == ["b", "d"]
    check_invariants(store)


def test_an_entry_alone_over_max_bytes_is_refused(make_store: MakeStore, caplog):
    store = make_store(max_bytes=1_000)
    store.put(entry("a"))
    huge = entry("huge", size=2_000)
    with caplog.at_level(logging.WARNING, logger="vllm.entrypoints.openai.responses_store"):
        assert not store.put(huge)
    assert huge.nbytes == json_size(huge) and "not stored" in caplog.text
    assert ids(store) == ["a"] and store.get("huge") is None  # nothing evicted for it
    check_invariants(store)


def test_a_chain_is_walked_to_its_first_response_marking_each(make_store: MakeStore):
    store = make_store(max_responses=4)
    for rid, prev in (("r1", None), ("r2", "r1"), ("r3", "r2")):
        store.put(entry(rid, prev))
    store.put(entry("idle"))
    assert [e.id for e in store.chain("r3")] == ["r1", "r2", "r3"]
    # Marked from the tip back: the first response is the most recent, idle the least.
    assert ids(store) == ["idle", "r3", "r2", "r1"]
    store.put(entry("r4", "r3"))  # the chain walked is protected: idle goes
    assert ids(store) == ["r3", "r2", "r1", "r4"]
    assert [e.id for e in store.chain("r4")] == ["r1", "r2", "r3", "r4"]
    check_invariants(store)


def test_a_cycle_is_no_chain(make_store: MakeStore):
    store = make_store()
    store.put(entry("a", "b"))
    store.put(entry("b", "a"))
    store.put(entry("self", "self"))
    assert store.chain("a") is None and store.chain("self") is None
    check_invariants(store)


def test_a_broken_chain_is_no_chain(make_store: MakeStore):
    store = make_store(max_responses=3)
    for rid, prev in (("r1", None), ("r2", "r1"), ("r3", "r2")):
        store.put(entry(rid, prev))
    assert store.chain("nope") is None
    store.put(entry("other"))  # evicts r1, the least recent
    assert store.get("r1") is None and store.chain("r3") is None and store.chain("r2") is None
    store.put(entry("r1"))
    assert [e.id for e in store.chain("r2")] == ["r1", "r2"]
    assert store.delete("r1") and store.chain("r2") is None
    check_invariants(store)


# -- the shared store across instances and processes --------------------------------------
def test_instances_on_one_file_see_each_others_puts_and_deletes(tmp_path):
    path = str(tmp_path / "responses.db")
    one, two = SharedResponseStore(path), SharedResponseStore(path)
    try:
        one.put(entry("a"))
        assert two.get("a").response == entry("a").response and len(two) == 1
        two.put(entry("b", "a"))
        assert [e.id for e in one.chain("b")] == ["a", "b"]
        assert one.delete("a") and two.get("a") is None and not two.delete("a")
        assert one.nbytes == two.nbytes == two.get("b").nbytes
    finally:
        one.close()
        two.close()


def test_a_use_in_one_instance_protects_from_eviction_in_another(tmp_path):
    path = str(tmp_path / "responses.db")
    one, two = SharedResponseStore(path, max_responses=2), SharedResponseStore(path)
    try:
        one.put(entry("a"))
        one.put(entry("b"))
        assert two.get("a") is not None  # a is now the most recent, for one as well
        one.put(entry("c"))
        assert ids(two) == ["a", "c"]
        assert two.chain("a") is not None  # likewise for a chain walk
        one.put(entry("d"))
        assert ids(one) == ["a", "d"]
        check_invariants(one)
    finally:
        one.close()
        two.close()


NUM_WORKERS = 3
PUTS_PER_WORKER = 50
SHARED_MAX_RESPONSES = 60
SHARED_MAX_BYTES = 15_000  # entries of ~150-550 bytes: sometimes bytes bind, sometimes count
JOIN_TIMEOUT_S = 30.0


def put_many(path: str, worker: int, start) -> None:
    """One process's part: open the store (all at once, on a new file), then put a chain
    of responses, walking it now and then, while the others do the same."""
    start.wait(timeout=JOIN_TIMEOUT_S)
    store = SharedResponseStore(path, SHARED_MAX_RESPONSES, SHARED_MAX_BYTES)
    previous = None
    for i in range(PUTS_PER_WORKER):
        rid = f"w{worker}-{i}"
        assert store.put(entry(rid, previous, size=100 * (i % 5)))
        previous = rid
        if i % 10 == 9:
            store.chain(rid)  # None once another process evicted its start: fine
        assert len(store) <= SHARED_MAX_RESPONSES
    store.close()


@pytest.mark.timeout(60)
def test_processes_putting_at_once_keep_the_bounds(tmp_path):
    path = str(tmp_path / "responses.db")
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(NUM_WORKERS)
    procs = [ctx.Process(target=put_many, args=(path, w, start)) for w in range(NUM_WORKERS)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(JOIN_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    assert [proc.exitcode for proc in procs] == [0] * NUM_WORKERS
    store = SharedResponseStore(path, SHARED_MAX_RESPONSES, SHARED_MAX_BYTES)
    try:
        check_invariants(store)
        assert len(store) > 0
        for rid, nbytes in lru_order(store):
            got = store.get(rid)
            assert got.id == rid and got.nbytes == nbytes == json_size(got)
    finally:
        store.close()
