"""The hybrid KV cache's scheduler side (``KVCacheManager`` with ``kv_cache_windows``):
a sliding-window group frees the blocks its window has passed, a prefix hit holds in every
group, and random workloads never read a position whose K/V another request overwrote.
Block size 4 throughout; block 0 is the null block."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import blocks_for_sequence, group_peak_blocks, kv_capacity_tokens

from .conftest import make_request

BS = 4


def manager(num_blocks: int = 40, windows=(None, 6), chunk: int | None = 8) -> KVCacheManager:
    return KVCacheManager(
        num_blocks, BS, max_model_len=256, kv_cache_windows=windows, max_num_batched_tokens=chunk
    )


def admit(m: KVCacheManager, req, chunk: int | None = None) -> int:
    """The scheduler's admission: prefix lookup, then a first chunk; tokens hit."""
    hit, n_hit = m.get_computed_blocks(req)
    n = req.num_tokens - n_hit if chunk is None else min(chunk, req.num_tokens - n_hit)
    assert m.allocate_slots(req, n, hit, n_hit) is not None
    req.num_computed_tokens = n_hit + n
    return n_hit


def decode(m: KVCacheManager, req, steps: int) -> None:
    for t in range(steps):
        req.append_output_token_ids(1000 + t)
        assert m.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def test_peak_blocks_and_capacity():
    # Full attention: every block. Window 6 over steps of 8 tokens: the step's 8 and the 5
    # positions before it span at most cdiv(13, 4) + 1 = 5 blocks.
    assert group_peak_blocks(100, BS, None, 8) == 25
    assert group_peak_blocks(100, BS, 6, 8) == 5
    assert group_peak_blocks(7, BS, 6, 8) == 2  # a short sequence holds all it has
    assert group_peak_blocks(100, BS, 6, None) == 25  # one step of 100 tokens holds them all
    assert blocks_for_sequence(100, BS, (None, 6), 8) == 30
    # One full group: blocks x block size, as before the groups.
    assert kv_capacity_tokens(39, BS) == 156
    # (None, 6): 39 blocks = 5 for the window + 34 full blocks.
    assert kv_capacity_tokens(39, BS, (None, 6), 8) == 34 * BS
    # Every group sliding (Mistral v0.1): any length fits once the window's blocks do.
    assert kv_capacity_tokens(5, BS, (6,), 8, limit=10_000) == 10_000
    assert kv_capacity_tokens(4, BS, (6,), 8, limit=10_000) == 16


def test_windows_are_checked():
    with pytest.raises(ValueError, match="kv_cache_windows"):
        KVCacheManager(10, BS, 64, kv_cache_windows=())
    with pytest.raises(ValueError, match="kv_cache_windows: a window must be an int >= 1"):
        KVCacheManager(10, BS, 64, kv_cache_windows=(None, 0))


def test_sliding_group_frees_what_its_window_passed():
    m = manager()
    a = make_request(list(range(30)))
    admit(m, a)  # 30 tokens in one step: 8 blocks in each group
    full, slide = m.get_block_ids(a.request_id)
    assert len(full) == len(slide) == 8 and 0 not in full + slide
    decode(m, a, 1)  # the next token (position 30) sees 25..30: blocks 0..5 are behind it
    full2, slide2 = m.get_block_ids(a.request_id)
    assert full2 == full and slide2 == [0] * 6 + slide[6:]
    assert m.get_num_blocks(a.request_id) == 8 + 2
    assert m.get_num_slots(a.request_id) == 32
    # The freed blocks keep their hash: evictable, not lost.
    assert all(m.block_pool.blocks[b].ref_cnt == 0 for b in slide[:6])
    assert all(m.block_pool.blocks[b].block_hash is not None for b in slide[:6])
    decode(m, a, 10)  # a long decode holds the window's blocks, not the context's
    _, slide3 = m.get_block_ids(a.request_id)
    assert sum(1 for b in slide3 if b) <= 3 and len(slide3) == 11
    m.check_invariants()
    m.free(a)
    m.check_invariants()
    assert m.usage == 0.0


def test_prefix_hit_needs_the_window_before_it_in_every_group():
    m = manager()
    a = make_request(list(range(30)))
    admit(m, a)
    decode(m, a, 1)  # the sliding group freed blocks 0..5 (hashed, in the free queue)
    b = make_request(list(range(30)) + [77, 78])
    hit, n_hit = m.get_computed_blocks(b)
    # 7 full blocks (28 tokens) in both groups; the sliding group needs only the last
    # cdiv(5, 4) = 2 of them (positions 23..27 for the token at 28): nulls before.
    assert n_hit == 28
    assert [x.block_id for x in hit[0]] == m.get_block_ids(a.request_id)[0][:7]
    assert [x.block_id for x in hit[1]][:5] == [0] * 5 and all(x.block_id for x in hit[1][5:])
    assert admit(m, b) == 28
    m.check_invariants()
    # Evict the sliding group's block 6 (cached, free): a hit may now end only where the
    # window before it is cached again, or run from the start.
    m.free(a)
    m.free(b)
    slide_block6 = next(
        blk for blk in m.block_pool.blocks if blk.block_hash == (1, b.block_hashes[6])
    )
    m.block_pool.uncache(slide_block6)
    c = make_request(list(range(30)) + [99])
    hit, n_hit = m.get_computed_blocks(c)
    # Window blocks before 28: 5, 6 (6 gone). Before 24: 4, 5: cached. So 24 tokens.
    assert n_hit == 24 and len(hit[0]) == len(hit[1]) == 6
    m.check_invariants()


def test_refused_allocation_changes_nothing_but_frees_passed_blocks():
    m = manager(num_blocks=14, chunk=None)  # 13 usable blocks
    a = make_request(list(range(20)))
    admit(m, a)  # 5 + 5 blocks
    b = make_request(list(range(100, 108)))
    before = (m.num_free_blocks, m.num_requests)
    assert m.allocate_slots(b, 8) is None  # needs 2 + 2
    assert (m.num_free_blocks, m.num_requests) == before
    # Position 20 sees 15..20: the sliding group frees blocks 0..2; it opens a sixth
    # block in each group.
    decode(m, a, 1)
    assert m.num_free_blocks == 3 + 3 - 2
    assert m.allocate_slots(b, 8) is not None
    m.check_invariants()


def test_one_full_group_behaves_as_before():
    m = manager(windows=(None,))
    a = make_request(list(range(30)))
    admit(m, a)
    decode(m, a, 5)
    (ids,) = m.get_block_ids(a.request_id)
    assert len(ids) == 9 and 0 not in ids and m.get_num_blocks(a.request_id) == 9


# -- random workloads against a model of the K/V each block holds ------------------------
PROMPTS = [list(range(n)) for n in (5, 13, 21, 30)] + [list(range(50, 75))]


class KVModel:
    """What each slot of each KV cache block holds (a block id's storage serves whichever
    group holds it): the group and the token prefix whose last K/V was written there; and
    the CPU tier's blocks, moved by the planned copies. A step checks that every position
    its tokens attend to (the window's, or all before for full attention) holds the
    request's own K/V for that group."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.slots: dict[tuple[int, int], tuple] = {}
        self.cpu: dict[int, dict[int, tuple]] = {}

    def transfer(self) -> None:
        """The step's copies, as the runner runs them: saves, then loads."""
        plan = self.m.take_kv_transfers()
        if plan is None:
            return
        bs = self.m.block_size
        for gpu, cpu in plan.saves:
            self.cpu[cpu] = {i: self.slots.get((gpu, i)) for i in range(bs)}
        for cpu, gpu in plan.loads:
            for i, held in self.cpu[cpu].items():
                self.slots[(gpu, i)] = held

    def step(self, req, num_new: int) -> None:
        m, bs = self.m, self.m.block_size
        self.transfer()
        tokens = req.all_token_ids
        groups = m.get_block_ids(req.request_id)
        start = req.num_computed_tokens
        for g, window in enumerate(m.windows):
            ids = groups[g]
            for p in range(start, start + num_new):
                first = 0 if window is None else max(0, p - window + 1)
                for q in range(first, start):  # computed before this step: must be intact
                    block = ids[q // bs]
                    assert block != 0, f"group {g}: position {q} (for {p}) was freed"
                    held = self.slots.get((block, q % bs))
                    assert held == (g, tuple(tokens[: q + 1])), f"group {g}: position {q} lost"
            for p in range(start, start + num_new):
                block = ids[p // bs]
                assert block != 0
                self.slots[(block, p % bs)] = (g, tuple(tokens[: p + 1]))


def run_random(m: KVCacheManager, seq) -> None:
    model = KVModel(m)
    live = []
    for op, arg in seq:
        if op == "add":
            req = make_request(list(PROMPTS[arg % len(PROMPTS)]) + [arg % 3], BS)
            hit, n_hit = m.get_computed_blocks(req)
            n_ext = m.get_num_offloaded_tokens(req, n_hit)
            chunk = min(1 + arg % 9, req.num_tokens - n_hit - n_ext)
            if m.allocate_slots(req, chunk, hit, n_hit, num_external_computed_tokens=n_ext) is None:
                continue
            req.num_computed_tokens = n_hit + n_ext
            model.step(req, chunk)
            req.num_computed_tokens += chunk
            live.append(req)
        elif op == "step" and live:
            req = live[arg % len(live)]
            if req.num_computed_tokens < req.num_tokens:
                n = min(1 + arg % 9, req.num_tokens - req.num_computed_tokens)
            else:
                req.append_output_token_ids(200 + arg)
                n = 1
            if req.num_computed_tokens + n > m.max_model_len or m.allocate_slots(req, n) is None:
                m.free(req)  # a recompute preemption
                live.remove(req)
                model.transfer()
                continue
            model.step(req, n)
            req.num_computed_tokens += n
        elif op in ("free", "offload") and live:
            m.free(live.pop(arg % len(live)), offload=op == "offload")
            model.transfer()
        m.check_invariants()
    for req in live:
        m.free(req)
    m.check_invariants()
    assert m.usage == 0.0


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add", "step", "step", "step", "free", "offload"]),
        st.integers(0, 40),
    ),
    min_size=1,
    max_size=80,
)


@pytest.mark.parametrize("windows", [(None, 6), (None, 5, 5), (6,), (None,), (None, 1)])
@pytest.mark.parametrize("tier", [0, 12])
@settings(max_examples=150, deadline=None)
@given(seq=ops)
def test_random_workloads_never_read_lost_kv(windows, tier, seq):
    m = KVCacheManager(
        24, BS, max_model_len=256, num_cpu_blocks=tier, cpu_block_bytes=1,
        kv_cache_windows=windows, max_num_batched_tokens=9,
    )  # fmt: skip
    run_random(m, seq)
