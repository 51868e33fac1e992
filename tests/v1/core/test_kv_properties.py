"""Random chunked prefill/decode/free/prefix-hit/reset sequences never leak or double-free."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.core.kv_cache_manager import KVCacheManager

from .conftest import apply_random_op

ops = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "free", "reset"]), st.integers(0, 30)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_ops_conserve_blocks(seq):
    m = KVCacheManager(9, block_size=4, max_model_len=64)  # 8 usable blocks
    live = []
    for op, arg in seq:
        reset = apply_random_op(m, live, op, arg)
        if op == "reset":
            assert reset == (m.num_requests == 0)
        m.check_invariants()
        pool = m.block_pool
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used + 1 == pool.num_gpu_blocks
        assert m.num_requests == len(live)
    for req in live:
        m.free(req)
    m.check_invariants()
    assert m.usage == 0.0
