"""KV cache manager scenarios. Block size 4 throughout; block 0 is the null block."""

from __future__ import annotations

from vllm.v1.core.kv_cache_manager import KVCacheManager

from .conftest import make_request


def manager(num_blocks: int = 11, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size=4, max_model_len=64, enable_caching=caching)


def admit(m: KVCacheManager, req) -> list[int]:
    """What the scheduler does for a waiting request: prefix lookup, then allocate."""
    hit, n_hit = m.get_computed_blocks(req)
    new = m.allocate_slots(req, req.num_tokens - n_hit, hit, n_hit)
    assert new is not None
    m.record_prefix_cache_query(req.num_tokens, n_hit)
    req.num_computed_tokens = req.num_tokens
    (ids,) = m.get_block_ids(req.request_id)  # one KV cache group
    return ids


def test_prefix_hit_on_shared_prompt_never_whole_prompt():
    m = manager()
    a = make_request(list(range(10)))  # 10 tokens: 2 full blocks + 1 partial -> 3 blocks
    a_blocks = admit(m, a)
    assert len(a_blocks) == 3
    b = make_request(list(range(10)) + [99])  # same 10 tokens + 1
    hit, n_hit = m.get_computed_blocks(b)
    assert [x.block_id for x in hit[0]] == a_blocks[:2] and n_hit == 8  # partial block not shared
    c = make_request(list(range(8)))  # exactly the 2 cached blocks: keep one token to compute
    hit, n_hit = m.get_computed_blocks(c)
    assert n_hit == 4
    b_blocks = admit(m, b)
    assert b_blocks[:2] == a_blocks[:2] and b_blocks[2] != a_blocks[2]
    assert m.block_pool.blocks[a_blocks[0]].ref_cnt == 2
    m.check_invariants()
    m.free(a)
    m.free(b)
    m.check_invariants()
    assert m.usage == 0.0
    stats = m.make_prefix_cache_stats()
    assert stats.requests == 2 and stats.queries == 10 + 11 and stats.hits == 8
    assert m.make_prefix_cache_stats().requests == 0  # deltas reset


def test_allocate_returns_none_without_side_effects():
    m = manager(num_blocks=5)  # 4 usable blocks = 16 tokens
    a = make_request(list(range(12)))
    admit(m, a)  # 3 blocks
    b = make_request(list(range(100, 108)))  # needs 2 blocks, 1 free
    before = (m.num_free_blocks, m.num_requests)
    assert m.allocate_slots(b, 8) is None
    assert (m.num_free_blocks, m.num_requests) == before
    m.check_invariants()


def test_revived_cached_block_counts_against_free():
    # 4 usable blocks. A fills 2 blocks and is freed: both stay cached in the free queue.
    m = manager(num_blocks=5)
    a = make_request(list(range(8)) + [50])
    admit(m, a)  # 3 blocks
    m.free(a)
    assert m.num_free_blocks == 4
    b = make_request(list(range(8)) + [60] * 7)  # 15 tokens = 4 blocks, 2 from the cache
    hit, n_hit = m.get_computed_blocks(b)
    assert n_hit == 8
    # The pitfall: 20 tokens need 3 new blocks, and 3 <= 4 free, but touching the 2 hits
    # takes them out of the free queue too: 3 + 2 > 4, so this must be refused untouched.
    big = make_request(list(range(8)) + [60] * 12)
    big_hit, n_big = m.get_computed_blocks(big)
    assert n_big == 8 and m.allocate_slots(big, 12, big_hit, n_big) is None
    assert m.num_free_blocks == 4 and all(x.ref_cnt == 0 for x in big_hit[0])
    m.check_invariants()
    # Needs 2 new + revives 2 free cached blocks = all 4 free blocks: fits exactly.
    assert m.allocate_slots(b, 7, hit, n_hit) is not None
    assert m.num_free_blocks == 0
    m.check_invariants()
    c = make_request(list(range(8)) + [70])  # hit on the same 2 (now in use) + 1 new block
    hit, n_hit = m.get_computed_blocks(c)
    assert n_hit == 8 and m.allocate_slots(c, 1, hit, n_hit) is None  # no free block left
    m.check_invariants()


def test_lru_eviction_tail_blocks_first():
    m = manager(num_blocks=9)  # 8 usable
    a = make_request(list(range(12)) + [1])  # 4 blocks; 3 full ones get cached
    a_ids = admit(m, a)
    m.free(a)  # freed in reverse: tail first, so the tail is evicted first
    free_order = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order[-4:] == list(reversed(a_ids))
    # Use the 4 never-used blocks, then one more: the evicted one is a's tail block.
    filler = make_request(list(range(200, 217)))  # 17 tokens = 5 blocks
    f_ids = admit(m, filler)
    assert f_ids[4] == a_ids[3]
    # a's first 3 blocks (cached) survive: a new request with a's prompt still hits 12 tokens.
    again = make_request(list(range(12)) + [1])
    assert m.get_computed_blocks(again)[1] == 12
    m.check_invariants()


def test_caching_disabled_gives_no_hits():
    m = manager(caching=False)
    a = make_request(list(range(10)))
    admit(m, a)
    m.free(a)
    assert m.get_computed_blocks(make_request(list(range(10))))[1] == 0
    assert m.block_pool.num_cached_blocks == 0


def test_reset_prefix_cache_only_when_idle():
    m = manager()
    a = make_request(list(range(9)))
    admit(m, a)
    assert not m.reset_prefix_cache()
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(make_request(list(range(9))))[1] == 0
    m.check_invariants()


def test_decode_growth_allocates_on_block_boundary():
    m = manager()
    a = make_request(list(range(4)))
    admit(m, a)  # 4 tokens = 1 block
    a.append_output_token_ids(7)
    assert m.allocate_slots(a, 1) != ([],)  # token 5 opens block 2
    a.num_computed_tokens += 1
    for t in range(3):
        a.append_output_token_ids(t)
        assert m.allocate_slots(a, 1) == ([],)  # tokens 6..8 fit in block 2
        a.num_computed_tokens += 1
    assert m.block_pool.num_cached_blocks == 2  # both blocks full and hashed
    m.free(a)
    m.check_invariants()


def test_free_keeps_blocks_referenced_by_another_holder():
    # A pinned request keeps its entry; a later turn hits its blocks, then the pin ends.
    m = manager()
    a = make_request(list(range(10)))
    a_ids = admit(m, a)  # 3 blocks, the first 2 full and cached
    b = make_request(list(range(10)) + [5, 6])
    b_ids = admit(m, b)  # 2 hit blocks (ref 2) + 1 new block
    assert m.num_requests == 2 and m.num_free_blocks == 10 - 4
    m.free(a)  # a's own tail block is freed; the shared 2 stay with b
    assert [m.block_pool.blocks[i].ref_cnt for i in b_ids[:2]] == [1, 1]
    assert m.num_free_blocks == 10 - 3 and m.num_requests == 1
    assert m.get_block_ids(b.request_id) == (b_ids,) and a_ids[:2] == b_ids[:2]
    m.free(a)  # unknown id now: a no-op
    m.check_invariants()
    m.free(b)
    assert m.usage == 0.0
    m.check_invariants()


def test_chunked_prefill_caches_only_computed_full_blocks():
    m = manager()
    a = make_request(list(range(10)))
    assert len(m.allocate_slots(a, 6)[0]) == 2  # tokens 0..5: blocks of 4 + 2
    assert m.block_pool.num_cached_blocks == 1  # only the first block is full
    a.num_computed_tokens = 6
    assert len(m.allocate_slots(a, 4)[0]) == 1  # tokens 6..9: a third block
    assert m.block_pool.num_cached_blocks == 2  # tokens 0..7 complete two blocks
    m.check_invariants()


def test_lookahead_allocates_ahead_without_caching_unknown_tokens():
    m = manager()
    a = make_request(list(range(12)))  # 3 full blocks, all hashed up front
    assert len(m.allocate_slots(a, 4, num_lookahead_tokens=4)[0]) == 2  # 8 slots
    # Only tokens 0..3 are computed this step: the second block's KV is not written yet,
    # so it must not be offered to other requests.
    assert m.block_pool.num_cached_blocks == 1
    m.check_invariants()


def test_allocate_refuses_request_larger_than_pool():
    m = manager(num_blocks=5)  # 4 usable blocks = 16 tokens
    a = make_request(list(range(17)))  # 5 blocks: can never fit
    assert not m.can_fit(a.num_tokens)
    assert m.allocate_slots(a, 17) is None
    assert m.num_requests == 0 and m.num_free_blocks == 4
    m.check_invariants()


def test_blocks_hashed_for_uncomputed_tokens_lose_their_hash_when_freed():
    # Scheduled (its 2 full blocks hashed at allocation) and preempted in the same step,
    # before the forward: num_computed_tokens is still 0, so the hashes name no data.
    m = manager()
    a = make_request(list(range(10)))
    assert m.allocate_slots(a, 10) is not None
    assert m.block_pool.num_cached_blocks == 2
    m.free(a)
    assert m.block_pool.num_cached_blocks == 0
    assert m.get_computed_blocks(make_request(list(range(10)) + [1]))[1] == 0
    m.check_invariants()


def test_offloading_free_without_a_tier_is_a_plain_free():
    m = manager()
    a = make_request(list(range(10)))
    admit(m, a)
    m.free(a, offload=True)
    assert m.usage == 0.0 and m.block_pool.num_cached_blocks == 2
    assert m.take_kv_transfers() is None
    m.check_invariants()
