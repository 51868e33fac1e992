"""Job-level order on upstream's scheduler: admission by the job's first arrival, pinned
jobs first, bounded waiting; preemption of the newest job's request, last steps last."""

from __future__ import annotations

import random

from conftest import make_request
from harness import make_scheduler, random_traffic, run_until_done, step

NO_PINS = {"continuum_ttl_mode": "fixed"}  # no tool in the text -> no pin: pure order


def test_an_old_jobs_next_turn_beats_a_new_jobs_first_turn(vllm_config):
    s = make_scheduler(vllm_config, max_num_seqs=1, text="", **NO_PINS)
    a1 = make_request(range(10), job="a")
    s.add_request(a1)
    run_until_done(s)
    s.clock.advance(1.0)
    runner = make_request(range(100, 104), max_tokens=3)
    s.add_request(runner)
    step(s)
    b1 = make_request(range(50, 60), job="b")  # arrives first...
    s.clock.advance(1.0)
    a2 = make_request([*a1.all_token_ids, 1], job="a")  # ...but a's job is older
    s.add_request(b1)
    s.add_request(a2)
    assert [r.request_id for r in s.waiting] == [a2.request_id, b1.request_id]
    admitted = []
    for _ in range(20):
        so, _ = step(s)
        admitted += [r.req_id for r in so.scheduled_new_reqs]
    assert admitted == [a2.request_id, b1.request_id]


def test_a_pinned_jobs_turn_goes_first(vllm_config):
    s = make_scheduler(vllm_config, max_num_seqs=1)
    old = make_request(range(10), job="old", last=True)  # the oldest job, never pinned
    s.add_request(old)
    s.add_request(make_request(range(50, 60), job="p"))
    run_until_done(s)
    assert len(s.pins) == 1
    s.add_request(make_request(range(100, 104), max_tokens=3))
    step(s)
    old2 = make_request([*old.all_token_ids, 1], job="old")
    p2 = make_request(range(70, 75), job="p")
    s.add_request(old2)
    s.add_request(p2)
    assert next(iter(s.waiting)) is p2


def test_bounded_waiting_serves_a_starved_request_first(vllm_config):
    s = make_scheduler(vllm_config, max_num_seqs=1, text="", max_wait_s=5.0, **NO_PINS)
    s.add_request(make_request(range(10), job="old"))
    run_until_done(s)
    s.clock.advance(1.0)
    s.add_request(make_request(range(100, 104), max_tokens=3))
    step(s)
    new = make_request(range(50, 60), job="new")
    s.add_request(new)
    s.clock.advance(1.0)
    s.add_request(make_request(range(60, 70), job="old"))
    assert s.waiting.peek_request() is not new
    s.clock.advance(5.0)  # new has now waited longer than max_wait_s
    assert s.waiting.peek_request() is new


def test_preemption_takes_the_newest_jobs_request_not_the_last_admitted(vllm_config):
    # 6 usable blocks. b (new job) is admitted before a's next turn (old job); when memory
    # runs out, upstream's FCFS would preempt a2 (admitted last); we preempt b.
    s = make_scheduler(vllm_config, num_blocks=7, text="", **NO_PINS)
    a1 = make_request(range(10), job="a")
    s.add_request(a1)
    run_until_done(s)
    s.clock.advance(1.0)
    b = make_request(range(50, 80), job="b", max_tokens=40)
    s.add_request(b)
    step(s)
    a2 = make_request([*a1.all_token_ids, 1, 2, 3, 4], job="a", max_tokens=40)
    s.add_request(a2)
    run_until_done(s)
    assert b.num_preemptions >= 1 and a2.num_preemptions == 0


def test_a_last_step_is_preempted_only_when_nothing_else_is_left(vllm_config):
    s = make_scheduler(vllm_config, num_blocks=7, text="", **NO_PINS)
    s.add_request(make_request(range(10), job="x"))  # make x the older job
    run_until_done(s)
    s.clock.advance(1.0)
    old_job = make_request(range(20, 50), job="y", max_tokens=40)
    s.add_request(old_job)
    step(s)
    s.clock.advance(1.0)
    newest_last = make_request(range(60, 90), job="z", last=True, max_tokens=40)
    s.add_request(newest_last)
    run_until_done(s)
    assert newest_last.num_preemptions == 0 and old_job.num_preemptions >= 1


def test_random_traffic_never_leaks_or_double_frees(vllm_config):
    """Random multi-turn jobs, tool gaps, aborts and memory pressure; the pool check runs
    after every step, and at the end every block is back."""
    s = make_scheduler(vllm_config, num_blocks=17, max_num_seqs=4)
    random_traffic(s, random.Random(0), 300)
    counters = s.pin_counters
    # The scenario exercises every path: pins, hits, expiries, pressure, preemption, aborts.
    assert min(counters.pins, counters.hits, counters.expiries, counters.pressure_releases) > 0
    assert s.make_stats().num_kv_fetch_reqs_by_stage["continuum:pins"] == counters.pins
    s.shutdown()
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1
