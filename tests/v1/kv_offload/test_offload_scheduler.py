"""The CPU KV tier through the scheduler: saves on eviction and on ``Offload``, loads on a
tier hit, per policy; block contents checked after every step (``FakeKV``)."""

from __future__ import annotations

import pytest

from vllm.utils.clock import FakeClock
from vllm_continuum.policy.base import Offload
from vllm_continuum.policy.plain import FCFSPolicy

from ..core.conftest import make_request
from ..core.sched.test_pinning import PinAll
from .helpers import FakeKV, make_offload_scheduler, offload_step, run_until_done

A = list(range(100, 113))  # 13 tokens: 3 full blocks of 4 + 1
B = list(range(200, 217))  # 17 tokens: needs all 5 usable blocks


class OffloadAll(FCFSPolicy):
    def on_finished(self, request, now):
        return Offload()


def _run(s, fkv, prompt, **kw):
    req = make_request(prompt, max_tokens=kw.pop("max_tokens", 1), **kw)
    s.add_request(req)
    run_until_done(s, fkv)
    return req


def test_fcfs_offloads_on_eviction_and_loads_on_the_next_hit():
    # 5 usable blocks. A leaves 3 cached full blocks; B needs all 5, so A's 3 are evicted,
    # and saved to the tier first. A again misses the pool, hits the tier: 3 loads.
    s = make_offload_scheduler(num_blocks=6, num_cpu_blocks=8)
    fkv = FakeKV(s)
    _run(s, fkv, A)
    assert fkv.saved == 0
    _run(s, fkv, B)
    assert fkv.saved == 3
    again = make_request(A, max_tokens=1)
    s.add_request(again)
    so, out = offload_step(s, fkv)
    assert len(so.kv_transfers.loads) == 3 and fkv.loaded == 3
    assert so.num_scheduled_tokens[again.request_id] == 1  # 12 of 13 tokens loaded
    assert out.outputs[0].num_cached_tokens == 12
    stats = out.scheduler_stats.connector_prefix_cache_stats  # this step's admission
    assert (stats.queries, stats.hits) == (13, 12)
    s.check_invariants()


def test_offload_action_saves_at_finish_and_never_twice():
    s = make_offload_scheduler(num_blocks=6, num_cpu_blocks=8, policy_obj=OffloadAll())
    fkv = FakeKV(s)
    _run(s, fkv, A)
    # Saved when freed (the next step's plan), though still cached in the pool.
    so, _ = offload_step(s, fkv)
    assert len(so.kv_transfers.saves) == 3
    _run(s, fkv, B)  # evicts A's blocks from the pool: already in the tier, no copy
    assert fkv.saved == 3
    _run(s, fkv, A)
    assert fkv.loaded == 3
    s.check_invariants()


def test_saves_never_evict_the_tier_blocks_of_a_planned_load():
    # A tier of 3 blocks holding A's 3 blocks; the pool holds B's 3 cached blocks only.
    # A's next turn (17 tokens: 5 blocks) loads A's 3 into new pool blocks; allocating them
    # evicts B's cached blocks, whose saves need tier room: the tier blocks being loaded
    # are held, so those saves are dropped, and the loads read A's data.
    s = make_offload_scheduler(num_blocks=6, num_cpu_blocks=3)
    fkv = FakeKV(s)
    kv = s.kv_cache_manager
    _run(s, fkv, A)
    for block in kv.block_pool.blocks[1:]:
        if block.block_hash is not None:
            kv.offload.save(block)
    offload_step(s, fkv)  # an empty step still runs its copies
    assert fkv.saved == 3
    kv.block_pool.reset_prefix_cache()  # the pool forgets A: only the tier has it
    _run(s, fkv, B[:13])
    a2 = make_request(A + [1, 2, 3, 4], max_tokens=1)
    s.add_request(a2)
    so, _ = offload_step(s, fkv)
    assert len(so.kv_transfers.loads) == 3 and not so.kv_transfers.saves
    assert a2.num_cached_tokens == 12
    run_until_done(s, fkv)
    s.check_invariants()


class PinNoRelease(PinAll):
    def may_release_pins_for(self, request, own_job_pinned, num_running, now):
        return False


def test_a_tier_hit_evicted_before_admission_is_recomputed():
    # A's tier hit is seen while a pin fills the pool, so A's turn waits. When the pin
    # expires it is offloaded, and its saves evict A's blocks from the 3-block tier before
    # A's turn is looked up again: A's turn recomputes everything, correctly.
    clock = FakeClock(start=0.0)
    s = make_offload_scheduler(
        num_blocks=6, num_cpu_blocks=3, policy_obj=PinNoRelease(ttl=5.0), clock=clock
    )
    fkv = FakeKV(s)
    kv = s.kv_cache_manager
    _run(s, fkv, A, job_id="a")  # pinned: 4 blocks held
    s.pins.release("a", clock.now, "expired")  # offloaded: 3 saves
    offload_step(s, fkv)
    kv.block_pool.reset_prefix_cache()  # only the tier has A now
    _run(s, fkv, B[:13], job_id="other")  # pinned: 4 of 5 blocks held
    turn = make_request(A + [1, 2, 3], max_tokens=1, job_id="a")  # 16 tokens: 4 blocks
    assert kv.get_num_offloaded_tokens(turn, 0) == 12
    s.add_request(turn)
    offload_step(s, fkv)
    assert turn.num_computed_tokens == 0  # waits: 1 free block, the pin may not go
    clock.advance(6)  # the pin expires, is offloaded, and evicts A from the tier
    so, _ = offload_step(s, fkv)
    assert len(so.kv_transfers.saves) == 3 and not so.kv_transfers.loads
    assert turn.num_cached_tokens == 0 and so.num_scheduled_tokens[turn.request_id] == 16
    run_until_done(s, fkv)
    assert fkv.loaded == 0
    s.check_invariants()


def test_pin_expiry_offloads_and_the_turn_after_the_tool_gap_loads_from_the_tier():
    clock = FakeClock(start=0.0)
    policy = PinAll(ttl=2.0)
    s = make_offload_scheduler(num_blocks=6, num_cpu_blocks=8, policy_obj=policy, clock=clock)
    fkv = FakeKV(s)
    t1 = _run(s, fkv, A, job_id="job")
    assert fkv.saved == 0
    clock.advance(2.5)  # the tool runs longer than the pin
    so, _ = offload_step(s, fkv)
    assert policy.released[-1][1] == "expired" and len(so.kv_transfers.saves) == 3
    _run(s, fkv, B, job_id="other", is_last_step=True)  # evicts the job's blocks
    t2 = make_request(t1.all_token_ids + [50, 51], job_id="job", is_last_step=True)
    s.add_request(t2)
    so, out = offload_step(s, fkv)
    assert len(so.kv_transfers.loads) == 3
    assert out.outputs[0].num_cached_tokens == t2.num_cached_tokens == 12
    run_until_done(s, fkv)
    s.check_invariants()


def test_continuum_offloads_an_expired_pin():
    clock = FakeClock(start=0.0)
    s = make_offload_scheduler(
        num_blocks=6, num_cpu_blocks=8, policy="continuum", clock=clock, max_wait_s=100
    )
    fkv = FakeKV(s)
    _run(s, fkv, A, job_id="job")  # a named non-last turn: pinned (cold-start TTL)
    assert len(s.pins) == 1 and fkv.saved == 0
    clock.advance(s.pins.next_deadline() + 1)
    offload_step(s, fkv)
    assert len(s.pins) == 0 and fkv.saved == 3


def test_loads_per_step_are_bounded_except_the_first():
    # Budget 16 tokens. Two requests with 12-token tier hits each: the first loads all
    # 12, the second only what is left of the budget (4 tokens: one block).
    s = make_offload_scheduler(num_blocks=20, num_cpu_blocks=16, budget=16)
    fkv = FakeKV(s)
    kv = s.kv_cache_manager
    prompts = [A, [p + 50 for p in A]]
    for p in prompts:
        _run(s, fkv, p)
    for block in kv.block_pool.blocks[1:]:
        if block.block_hash is not None:
            kv.offload.save(block)
    offload_step(s, fkv)  # runs the saves
    kv.block_pool.reset_prefix_cache()
    reqs = [make_request(p, max_tokens=1) for p in prompts]
    for r in reqs:
        s.add_request(r)
    so, _ = offload_step(s, fkv)
    assert len(so.kv_transfers.loads) == 4
    assert [r.num_cached_tokens for r in reqs] == [12, 4]
    run_until_done(s, fkv)
    s.check_invariants()


@pytest.mark.parametrize(
    ("num_cpu_blocks", "yields", "waits"),
    [(8, True, False), (8, False, True), (0, True, True)],
    ids=["tier", "tier-no-yield", "no-tier"],
)
def test_with_a_tier_another_jobs_turn_takes_a_pin_at_once(num_cpu_blocks, yields, waits):
    # Job a's context is pinned (4 of 5 blocks), job r runs in the last block. Job b's
    # turn needs 2 blocks: with a tier it takes a's pin at once (saved to the tier first);
    # without one (or with pins_yield_to_tier off) it waits for the pin while r runs.
    clock = FakeClock(start=0.0)
    s = make_offload_scheduler(
        num_blocks=6,
        num_cpu_blocks=num_cpu_blocks,
        policy="continuum",
        clock=clock,
        max_wait_s=100,
        pins_yield_to_tier=yields,
    )
    fkv = FakeKV(s)
    _run(s, fkv, A, job_id="a")
    assert s.pins.pinned.num_blocks == 4
    runner = make_request([300], max_tokens=3, job_id="r", is_last_step=True)
    s.add_request(runner)
    offload_step(s, fkv)
    turn = make_request(B[:8], max_tokens=1, job_id="b", is_last_step=True)
    s.add_request(turn)
    so, _ = offload_step(s, fkv)
    assert (turn.request_id not in so.num_scheduled_tokens) == waits
    assert ("a" in s.pins) == waits
    if not waits:
        assert fkv.saved == 3  # a's full blocks went to the tier before b took them
    run_until_done(s, fkv)
    s.check_invariants()
