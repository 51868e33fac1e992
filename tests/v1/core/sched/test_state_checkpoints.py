"""Checkpoints of recurrent states at block boundaries (state_checkpoints.py): the
scheduler's bookkeeping alone, then inside the scheduler (a prompt's chunk cut at its
last boundary, a prefix hit cut back to the deepest checkpoint, the runner told what to
restore and save)."""

from __future__ import annotations

from vllm.v1.core.sched.state_checkpoints import StateCheckpoints, StateRestore

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done, step

BS = 4
LONG = 100  # a prompt whose boundary no test reaches: every checkpoint is a latest one


def test_plan_saves_on_block_boundaries_only_and_overwrites_the_latest():
    c = StateCheckpoints(2, BS)
    assert c.plan("a", 3, LONG) is None  # no slot taken for a step that ends mid-block
    slot = c.plan("a", 8, LONG)
    assert slot is not None and c.plan("a", 9, LONG) is None and c.plan("a", 12, LONG) == slot
    assert c.saves == 2
    c.check_invariants()


def test_the_prompts_checkpoint_has_a_slot_of_its_own():
    c = StateCheckpoints(3, BS)
    first = c.plan("a", 4, 10)  # before the prompt's boundary (8): a latest one
    prompt = c.plan("a", 8, 10)
    latest = c.plan("a", 12, 10)
    assert len({first, prompt}) == 2 and latest == first
    c.release("a", "job", ["h1", "h2", "h3"], keep=True)
    assert len(c) == 2
    assert c.hit(["h1", "h2", "h3", "h4"], 16) == (12, StateRestore(latest))  # deepest first
    assert c.hit(["h1", "h2", "x"], 12) == (8, StateRestore(prompt))  # diverged after it
    assert c.hit(["h1", "y"], 8) == (0, None)
    c.check_invariants()


def test_a_failed_request_leaves_no_checkpoint():
    c = StateCheckpoints(1, BS)
    c.plan("a", 4, LONG)
    c.release("a", "job", ["h1"], keep=False)
    assert len(c) == 0 and c.plan("b", 4, LONG) is not None  # its slot free again
    c.check_invariants()


def test_least_recently_used_goes_first_and_a_pinned_job_last():
    pinned = {"keep"}
    c = StateCheckpoints(2, BS, is_pinned=pinned.__contains__)
    c.plan("a", 4, LONG)
    c.release("a", "keep", ["a1"], keep=True)
    c.plan("b", 4, LONG)
    c.release("b", "other", ["b1"], keep=True)
    c.plan("c", 4, LONG)  # evicts b's: a's is older, but its job holds a pin
    assert c.hit(["a1"], 4)[0] == 4 and c.hit(["b1"], 4) == (0, None)
    assert c.evictions == 1
    pinned.clear()
    c.release("c", "x", ["c1"], keep=True)  # the cache: a1 (used above), then c1
    c.plan("d", 4, LONG)  # nobody pinned: the least recently used, a's, goes
    assert c.hit(["c1"], 4)[0] == 4 and c.hit(["a1"], 4) == (0, None)
    c.check_invariants()


def test_a_pinned_jobs_checkpoint_is_never_evicted():
    """Every cached checkpoint a pinned job's: a new one goes without a slot."""
    pinned = {"keep"}
    c = StateCheckpoints(1, BS, is_pinned=pinned.__contains__)
    c.plan("a", 4, LONG)
    c.release("a", "keep", ["a1"], keep=True)
    assert c.plan("b", 4, LONG) is None and c.hit(["a1"], 4)[0] == 4
    pinned.clear()  # the pin ends: the slot can be had
    assert c.plan("b", 4, LONG) is not None and c.evictions == 1
    c.check_invariants()


def test_no_slot_to_be_had_means_no_checkpoint():
    c = StateCheckpoints(1, BS)
    assert c.plan("a", 4, LONG) is not None
    assert c.plan("b", 4, LONG) is None  # a's slot is a running request's: never evicted
    c.check_invariants()


def test_the_same_prefix_twice_keeps_one_checkpoint():
    c = StateCheckpoints(2, BS)
    c.plan("a", 4, LONG)
    c.plan("b", 4, LONG)
    c.release("a", "j", ["h"], keep=True)
    c.release("b", "j", ["h"], keep=True)
    assert len(c) == 1
    c.check_invariants()


def _scheduler(budget: int = 8):
    s = make_scheduler(budget=budget, max_num_seqs=4)
    s.state_checkpoints = StateCheckpoints(4, s.block_size, s.pins.__contains__)
    return s


def test_the_prompts_last_chunk_stops_on_its_last_boundary():
    s = _scheduler(budget=32)
    r = make_request(list(range(10)), max_tokens=3)
    s.add_request(r)
    so, _ = step(s)
    assert so.num_scheduled_tokens[r.request_id] == 8  # not 10: the state at 8 is saved
    assert list(so.state_checkpoints) == [r.request_id]
    so, _ = step(s)
    assert so.num_scheduled_tokens[r.request_id] == 2 and not so.state_checkpoints
    run_until_done(s)
    s.check_invariants()


def _turn_one(s, max_tokens: int) -> tuple[object, list[int]]:
    t1 = make_request(list(range(10)), max_tokens=max_tokens, job_id="job")
    s.add_request(t1)
    saved = []
    while s.has_unfinished_requests():
        so, _ = step(s)
        saved += list(so.state_checkpoints.values())
    return t1, saved


def test_next_turn_hits_up_to_the_deepest_checkpoint_and_restores_it():
    """Turn one: a 10-token prompt (chunks of 8 and 2: the prompt's checkpoint at 8) and 6
    tokens (a decode ends on 12: the latest there; KV of 15 tokens). Turn two repeats it
    and adds three: its hit, the 3 full blocks (12 tokens), ends on the latest."""
    s = _scheduler()
    t1, saved = _turn_one(s, 6)
    assert len(s.state_checkpoints) == 2 and len(set(saved)) == 2
    t2 = make_request(t1.all_token_ids + [50, 51, 52], max_tokens=2, job_id="job")
    s.add_request(t2)
    so, out = step(s)
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 12 and new.state_restore == StateRestore(saved[-1])
    assert out.outputs == [] or out.outputs[0].num_cached_tokens == 12
    run_until_done(s)
    s.check_invariants()


def test_a_hit_past_the_last_checkpoint_is_cut_back_to_one():
    """Turn one's checkpoints at 8 (its prompt's) and 16 (KV of 17 tokens). A request
    sharing its first 14 tokens hits 3 blocks (12), cut back to 8: from the prompt's."""
    s = _scheduler()
    t1, saved = _turn_one(s, 8)
    t2 = make_request(t1.all_token_ids[:14] + [70, 71, 72], max_tokens=2)
    s.add_request(t2)
    so, _ = step(s)
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and new.state_restore == StateRestore(saved[0])
    assert so.num_scheduled_tokens[t2.request_id] == 8  # to 16, its prompt's boundary
    run_until_done(s)
    s.check_invariants()


def test_stats_and_prometheus_report_the_checkpoints():
    """Turn one (10 + 6 tokens) saves 2 checkpoints (8, its prompt's; 12, its latest); turn
    two (19 tokens) restores 12's and saves 2 (16, its prompt's; 20, a decode's); each
    step's report carries the deltas, the cache's size a gauge."""
    from prometheus_client import CollectorRegistry

    from vllm.v1.metrics.prometheus import PrometheusStatLogger

    s = _scheduler()
    logger = PrometheusStatLogger("m", registry=CollectorRegistry())
    totals = {"saves": 0, "restores": 0}
    t1 = make_request(list(range(10)), max_tokens=6, job_id="job")
    for request in (t1, None):
        if request is None:
            request = make_request(t1.all_token_ids + [50, 51, 52], max_tokens=2)
        s.add_request(request)
        while s.has_unfinished_requests():
            _, out = step(s)
            stats = out.scheduler_stats.state_checkpoint_stats
            totals["saves"] += stats.saves
            totals["restores"] += stats.restores
            logger.record(out, [])

    def value(name):
        return logger.registry.get_sample_value(name, {"model_name": "m", "engine": "0"})

    assert totals == {"saves": 4, "restores": 1}
    assert value("vllm:recurrent_state_checkpoint_saves_total") == 4
    assert value("vllm:recurrent_state_checkpoint_restores_total") == 1
    assert value("vllm:recurrent_state_checkpoints") == stats.cached == 4
    assert make_scheduler().make_stats().state_checkpoint_stats is None  # other models


def test_the_same_prompt_again_hits_its_checkpoint_even_on_a_block_multiple():
    """A 12-token prompt (3 blocks of 4): a hit always leaves the last token to compute, so
    the prompt's checkpoint is at 8, not 12, and the same prompt again restarts there."""
    s = _scheduler(budget=32)
    first = make_request(list(range(12)), max_tokens=1)
    s.add_request(first)
    so, _ = step(s)
    assert so.num_scheduled_tokens[first.request_id] == 8 and so.state_checkpoints
    run_until_done(s)
    again = make_request(list(range(12)), max_tokens=1)
    s.add_request(again)
    so, _ = step(s)
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and new.state_restore is not None
    run_until_done(s)
    s.check_invariants()


def test_the_prompts_checkpoint_is_shared_once_written_while_its_request_runs():
    """A fork of a running request's prompt, added after the prompt's checkpoint step has
    run: it restarts from that checkpoint before the first request ends."""
    s = _scheduler(budget=32)
    first = make_request(list(range(10)), max_tokens=8)
    s.add_request(first)
    step(s)  # the prompt to 8: its checkpoint saved, and (its step run) in the cache
    assert len(s.state_checkpoints) == 1
    step(s)
    fork = make_request(list(range(10)), max_tokens=2)
    s.add_request(fork)
    so, _ = step(s)
    new = so.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and new.state_restore is not None
    assert first.request_id in s.requests  # still running
    run_until_done(s)
    s.check_invariants()


def test_a_failed_step_shares_no_checkpoint():
    """The prompt's checkpoint enters the cache only when its step ran: a request that
    fails in that step leaves none behind."""
    from vllm.v1.outputs import RequestFailure

    from .helpers import fake_output

    s = _scheduler(budget=32)
    r = make_request(list(range(10)), max_tokens=2)
    s.add_request(r)
    so = s.schedule()
    assert so.state_checkpoints
    out = fake_output(so, s)
    out.errors = {r.request_id: RequestFailure("boom")}
    s.update_from_output(so, out)
    assert len(s.state_checkpoints) == 0
    s.check_invariants()


# -- the host tier (with the CPU KV tier) ------------------------------------------------
def _cached(c: StateCheckpoints, req: str, key: str) -> None:
    """A finished request's checkpoint at 4 tokens, under ``key``."""
    c.plan(req, 4, LONG)
    c.release(req, "job", [key], keep=True)


def test_an_evicted_checkpoint_is_offloaded_and_hit_in_host_memory():
    c = StateCheckpoints(1, BS, num_host_slots=2)
    _cached(c, "a", "a1")
    slot = c.plan("b", 4, LONG)  # evicts a1's device slot: copied to host slot 0 first
    assert c.take_offloads() == [(slot, 0)] and c.take_offloads() == []
    assert c.hit(["a1"], 4) == (4, StateRestore(0, host=True))
    assert (c.evictions, c.offloads, c.num_offloaded, len(c)) == (1, 1, 1, 0)
    c.release("b", "job", ["a1"], keep=True)  # the same prefix on the device again
    assert c.hit(["a1"], 4) == (4, StateRestore(slot))  # the device's first
    c.check_invariants()


def test_without_host_slots_an_evicted_checkpoint_is_gone():
    c = StateCheckpoints(1, BS)
    _cached(c, "a", "a1")
    c.plan("b", 4, LONG)
    assert c.take_offloads() == [] and c.hit(["a1"], 4) == (0, None)


def test_the_host_tier_evicts_its_least_recently_used_but_never_a_held_slot():
    c = StateCheckpoints(1, BS, num_host_slots=2)
    for req, key in (("a", "a1"), ("b", "b1"), ("c", "c1")):
        _cached(c, req, key)  # each evicts the one before it to host
    c.take_offloads()
    assert c.num_offloaded == 2  # a1 (host slot 0), b1 (1)
    _, restore = c.hit(["a1"], 4)  # a1 becomes the most recent
    c.use(restore)  # admitted: host slot 0 held for this step's copy
    c.plan("d", 4, LONG)  # evicts c1 to host: b1's slot, the least recently used
    assert c.take_offloads() == [(0, 1)]
    assert c.hit(["b1"], 4) == (0, None) and c.hit(["c1"], 4)[1] == StateRestore(1, host=True)
    _cached(c, "e", "e1")  # no plan yet: d's slot is its own until it ends
    c.release("d", "job", ["d1"], keep=True)
    _, restore = c.hit(["a1"], 4)
    c.use(restore)
    _cached(c, "f", "f1")  # evicts one of d1/e1; a1's slot is held: c1's goes
    assert [h for _, h in c.take_offloads()] == [1]
    assert c.hit(["a1"], 4)[0] == 4 and c.hit(["c1"], 4) == (0, None)
    assert c.restores == 2
    c.check_invariants()


def test_a_failed_steps_offloads_are_forgotten_and_a_reset_clears_the_host_tier():
    c = StateCheckpoints(1, BS, num_host_slots=2)
    _cached(c, "a", "a1")
    c.plan("b", 4, LONG)
    c.discard_offloads(c.take_offloads())  # its copy may not have run
    assert c.hit(["a1"], 4) == (0, None) and c.num_offloaded == 0
    c.release("b", "job", ["b1"], keep=True)
    _cached(c, "c", "c1")
    c.take_offloads()
    assert c.num_offloaded == 1
    c.clear()
    assert c.num_offloaded == 0 and len(c) == 0
    c.check_invariants()


def test_stats_count_offloads():
    c = StateCheckpoints(1, BS, num_host_slots=1)
    _cached(c, "a", "a1")
    _cached(c, "b", "b1")
    stats = c.take_stats()
    assert (stats.cached, stats.evictions, stats.offloaded, stats.offloads) == (1, 1, 1, 1)
    assert c.take_stats().offloads == 0


def test_a_step_with_drafts_never_reaches_a_block_boundary():
    """Speculative decoding: how many drafts a step keeps is known only after it, so a
    drafted step stops short of the next block boundary (where the states would be
    checkpointed), and the step that reaches the boundary carries no drafts and saves."""
    s = make_scheduler(budget=64, max_num_seqs=4,
                       speculative={"method": "ngram", "num_speculative_tokens": 3})  # fmt: skip
    s.state_checkpoints = StateCheckpoints(4, s.block_size, s.pins.__contains__)
    r = make_request([1, 2, 3] * 5, max_tokens=40)
    s.add_request(r)
    drafted = saved_at = 0
    while s.has_unfinished_requests():
        so, _ = step(s)
        cached = so.scheduled_cached_reqs
        if r.request_id not in cached.req_ids:
            continue
        p = cached.num_computed_tokens[cached.req_ids.index(r.request_id)]
        end = p + so.num_scheduled_tokens[r.request_id]
        boundary = (p // BS + 1) * BS
        if so.scheduled_spec_decode_tokens.get(r.request_id):
            drafted += 1
            assert end < boundary, (p, end)
        assert (end == boundary) == (r.request_id in so.state_checkpoints), (p, end)
        saved_at += end == boundary
    assert drafted > 5 and saved_at > 5
    s.check_invariants()
