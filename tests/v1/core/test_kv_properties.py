"""Random chunked prefill/decode/free/prefix-hit/reset sequences never leak or double-free."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.core.kv_cache_manager import KVCacheManager

from .conftest import make_request

# Shared prefixes so that later requests hit blocks of earlier (live or freed) ones.
PROMPTS = [list(range(n)) for n in (3, 9, 13, 17, 22)] + [list(range(50, 61))]

ops = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "free", "reset"]), st.integers(0, 30)),
    min_size=1,
    max_size=60,
)


def _step(m: KVCacheManager, req, arg: int) -> bool:
    """One scheduled step of a live request (prefill chunk or decode); False if short."""
    if req.num_computed_tokens < req.num_tokens:
        num_new = min(1 + arg % 6, req.num_tokens - req.num_computed_tokens)
    else:
        req.append_output_token_ids(arg)
        num_new = 1
    if m.allocate_slots(req, num_new, num_lookahead_tokens=arg % 3) is None:
        return False
    req.num_computed_tokens += num_new
    return True


def _add(m: KVCacheManager, arg: int):
    req = make_request(list(PROMPTS[arg % len(PROMPTS)]))
    hit, n_hit = m.get_computed_blocks(req)
    assert n_hit < req.num_tokens  # never the whole prompt
    remaining = req.num_tokens - n_hit
    # Half the time the whole rest of the prompt at once (memory pressure), else a chunk.
    chunk = remaining if (arg // len(PROMPTS)) % 2 else min(1 + arg % 8, remaining)
    before = (m.num_free_blocks, m.num_requests)
    if m.allocate_slots(req, chunk, hit, n_hit) is None:
        assert (m.num_free_blocks, m.num_requests) == before  # refused: nothing changed
        return None
    req.num_computed_tokens = n_hit + chunk
    return req


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_ops_conserve_blocks(seq):
    m = KVCacheManager(9, block_size=4, max_model_len=64)  # 8 usable blocks
    live = []
    for op, arg in seq:
        if op == "add":
            req = _add(m, arg)
            if req is not None:
                live.append(req)
        elif op == "step" and live:
            req = live[arg % len(live)]
            if not _step(m, req, arg):
                m.free(req)  # what recompute preemption does
                live.remove(req)
        elif op == "free" and live:
            m.free(live.pop(arg % len(live)))
        elif op == "reset":
            assert m.reset_prefix_cache() == (m.num_requests == 0)
        m.check_invariants()
        pool = m.block_pool
        used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert pool.get_num_free_blocks() + used + 1 == pool.num_gpu_blocks
        assert m.num_requests == len(live)
    for req in live:
        m.free(req)
    m.check_invariants()
    assert m.usage == 0.0
