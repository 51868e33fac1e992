"""The tier's bookkeeping: LRU order, holds for planned loads, conservation."""

from __future__ import annotations

import pytest

from vllm.v1.kv_offload.cpu_pool import CPUBlockPool


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_lru_evicts_the_least_recently_stored_or_touched():
    pool = CPUBlockPool(3)
    ids = [pool.allocate(h(i)) for i in range(3)]
    assert ids == [0, 1, 2] and pool.usage == 1.0
    pool.touch(h(0))  # used again: now the most recent
    assert pool.lru_hashes() == [h(1), h(2), h(0)]
    assert pool.allocate(h(3)) == 1  # evicts h(1), the least recent
    assert h(1) not in pool and pool.lru_hashes() == [h(2), h(0), h(3)]
    pool.check_invariants()


def test_held_blocks_are_not_evicted_and_rejoin_as_most_recent():
    pool = CPUBlockPool(2)
    pool.allocate(h(0))
    pool.allocate(h(1))
    assert pool.lookup([h(0), h(1), h(2)]) == 2
    held = pool.acquire([h(0), h(1)])
    assert pool.allocate(h(2)) is None  # everything is being loaded: the save is dropped
    pool.check_invariants()
    pool.release(held[1:])
    assert pool.allocate(h(2)) == held[1]  # only h(1) was evictable
    assert not pool.reset()  # refused while a load holds a block
    pool.release(held[:1])
    assert pool.lru_hashes() == [h(2), h(0)]
    pool.check_invariants()
    assert pool.reset() and pool.num_used_blocks == 0


def test_storing_a_present_hash_is_refused():
    pool = CPUBlockPool(2)
    pool.allocate(h(0))
    with pytest.raises(ValueError):
        pool.allocate(h(0))
    with pytest.raises(ValueError, match="num_blocks"):
        CPUBlockPool(0)


def test_discard_forgets_blocks_whose_copy_never_ran():
    # A step failed before its saves ran: their tier blocks must not serve a hit.
    pool = CPUBlockPool(3)
    ids = [pool.allocate(h(i)) for i in range(2)]
    pool.discard([ids[1], ids[1], 2])  # twice, and a free block: skipped
    assert h(0) in pool and h(1) not in pool and pool.num_used_blocks == 1
    assert pool.lookup([h(0), h(1)]) == 1
    pool.check_invariants()
    held = pool.acquire([h(0)])
    with pytest.raises(ValueError, match="held"):
        pool.discard(held)
    pool.release(held)
    assert pool.allocate(h(1)) in (ids[1], 2)
    pool.check_invariants()
