"""Random allocate/decode/free/prefix-hit sequences never leak or double-free a block."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.core.kv_cache_manager import KVCacheManager

from .conftest import make_request

PROMPTS = [list(range(n)) for n in (3, 5, 9, 13)] + [list(range(50, 61))]

ops = st.lists(
    st.tuples(st.sampled_from(["add", "decode", "free"]), st.integers(0, 30)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_ops_conserve_blocks(seq):
    m = KVCacheManager(12, block_size=4, max_model_len=64)
    live = []
    for op, arg in seq:
        if op == "add":
            req = make_request(list(PROMPTS[arg % len(PROMPTS)]))
            hit, n_hit = m.get_computed_blocks(req)
            if m.allocate_slots(req, req.num_tokens - n_hit, hit, n_hit) is not None:
                req.num_computed_tokens = req.num_tokens
                live.append(req)
        elif op == "decode" and live:
            req = live[arg % len(live)]
            req.append_output_token_ids(arg)
            if m.allocate_slots(req, 1) is None:
                m.free(req)  # what preemption does
                live.remove(req)
            else:
                req.num_computed_tokens += 1
        elif op == "free" and live:
            m.free(live.pop(arg % len(live)))
        m.check_invariants()
        pool = m.block_pool
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used + 1 == pool.num_gpu_blocks
    for req in live:
        m.free(req)
    m.check_invariants()
    assert m.usage == 0.0
