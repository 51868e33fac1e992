"""BlockPool: null block, LRU free order, lazy eviction, revival by touch, hash map."""

from __future__ import annotations

import pytest

from vllm.v1.core.block_pool import BlockPool

from .conftest import make_request


def ids(blocks):
    return [b.block_id for b in blocks]


def free_order(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def cached_pool(num_blocks: int, prompt: list[int]):
    """A pool whose first blocks hold the full blocks of ``prompt`` (block size 4), freed."""
    pool = BlockPool(num_blocks)
    req = make_request(prompt, block_size=4)
    n = len(req.block_hashes)
    blocks = pool.get_new_blocks(n)
    pool.cache_full_blocks(req, blocks, 0, n, 4)
    pool.free_blocks(reversed(blocks))
    return pool, req, blocks


def test_null_block_excluded_from_usage():
    pool = BlockPool(11)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 10  # 11 blocks, null block 0 excluded
    assert pool.get_usage() == 0.0
    blocks = pool.get_new_blocks(5)
    assert 0 not in ids(blocks) and all(b.ref_cnt == 1 for b in blocks)
    assert pool.get_usage() == pytest.approx(0.5)  # 5 of 10 usable
    pool.free_blocks(blocks + [pool.null_block])  # the null block is never freed
    assert 0 not in free_order(pool)
    pool.check_invariants()
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(blocks)


def test_get_new_blocks_short_raises_and_changes_nothing():
    pool = BlockPool(4)  # 3 usable
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="num_blocks"):
        pool.get_new_blocks(-1)
    assert pool.get_num_free_blocks() == 1
    pool.check_invariants()


def test_freed_blocks_join_tail_in_given_order():
    pool = BlockPool(6)  # usable 1..5
    blocks = pool.get_new_blocks(3)  # 1, 2, 3; free queue [4, 5]
    pool.free_blocks(reversed(blocks))  # tail first: queue [4, 5, 3, 2, 1]
    assert free_order(pool) == [4, 5, 3, 2, 1]
    assert ids(pool.get_new_blocks(3)) == [4, 5, 3]  # least recently freed go first
    pool.check_invariants()


def test_touch_revives_cached_free_block():
    pool, req, blocks = cached_pool(6, list(range(9)))  # 2 full blocks cached, then freed
    assert pool.get_num_free_blocks() == 5 and pool.num_cached_blocks == 2
    hit = pool.get_cached_block(req.block_hashes[0])
    assert hit is blocks[0] and hit.ref_cnt == 0
    pool.touch([hit])  # the hit leaves the free queue: one free block fewer
    assert pool.get_num_free_blocks() == 4 and hit.ref_cnt == 1
    assert hit.block_hash == req.block_hashes[0]  # reviving keeps the hash
    pool.touch([hit, pool.null_block])  # a second holder; the null block is ignored
    assert hit.ref_cnt == 2 and pool.null_block.ref_cnt == 0
    pool.free_blocks([hit, hit])
    pool.check_invariants()


def test_popping_cached_block_evicts_its_hash_lazily():
    pool, req, blocks = cached_pool(3, list(range(8)))  # 2 usable, both cached and free
    # Freed tail first: the queue is [block of hash 1, block of hash 0].
    assert free_order(pool) == [blocks[1].block_id, blocks[0].block_id]
    (popped,) = pool.get_new_blocks(1)
    assert popped is blocks[1] and popped.block_hash is None
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]  # still cached
    assert pool.num_cached_blocks == 1
    pool.check_invariants()


def test_duplicate_hash_keeps_both_blocks():
    # Two requests computed the same prefix at once: both blocks carry the hash.
    pool = BlockPool(5)
    req = make_request(list(range(5)), block_size=4)  # 1 full block
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(req, a, 0, 1, 4)
    pool.cache_full_blocks(req, b, 0, 1, 4)
    assert pool.num_cached_blocks == 2
    first = pool.get_cached_block(req.block_hashes[0])
    assert first is a[0]
    pool.free_blocks(a)
    pool.get_new_blocks(pool.get_num_free_blocks())  # evicts a's copy (b is in use)
    assert pool.get_cached_block(req.block_hashes[0]) is b[0]
    pool.check_invariants()


def test_cache_full_blocks_skips_hashed_and_respects_disabled_caching():
    pool, req, blocks = cached_pool(6, list(range(8)))
    pool.touch(blocks)
    pool.cache_full_blocks(req, blocks, 0, 2, 4)  # already hashed: nothing new
    assert pool.num_cached_blocks == 2
    off = BlockPool(6, enable_caching=False)
    blocks = off.get_new_blocks(2)
    off.cache_full_blocks(req, blocks, 0, 2, 4)
    assert off.num_cached_blocks == 0 and off.get_cached_block(req.block_hashes[0]) is None
    off.check_invariants()


def test_reset_prefix_cache_refused_while_in_use():
    pool, req, blocks = cached_pool(6, list(range(8)))
    pool.touch(blocks[:1])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(req.block_hashes[0]) is None
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0  # in use but claims to be free: a leak
    with pytest.raises(AssertionError, match="ref_cnt"):
        pool.check_invariants()
    block.ref_cnt = 1
    block.block_hash = b"stray"  # a hash the map does not know
    with pytest.raises(AssertionError, match="not in map"):
        pool.check_invariants()
