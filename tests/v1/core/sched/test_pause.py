"""The scheduler's pause states (vLLM's pause of generation): PAUSED_NEW admits no waiting
request and steps the running ones, PAUSED_ALL schedules nothing and keeps every block."""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import PauseState
from vllm.v1.request import RequestStatus

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done, step
from .test_pinning import setup, turn


def test_paused_new_steps_the_running_requests_and_admits_no_waiting_one():
    s = make_scheduler()
    running = make_request(list(range(8)), max_tokens=3)
    s.add_request(running)
    step(s)  # the prompt and the first token
    s.set_pause_state(PauseState.PAUSED_NEW)
    late = make_request(list(range(8)), max_tokens=2)
    s.add_request(late)
    assert s.has_work()
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == [running.request_id]
    step(s)  # the third token: running is done
    assert running.request_id not in s.requests
    assert not s.running and not s.has_work() and s.has_unfinished_requests()
    so, _ = step(s)
    assert so.is_empty and late.status == RequestStatus.WAITING
    s.set_pause_state(PauseState.UNPAUSED)
    assert s.has_work()
    run_until_done(s)
    assert late.num_output_tokens == 2 and s.kv_cache_manager.usage == 0.0


def test_paused_all_schedules_nothing_and_keeps_the_blocks():
    s = make_scheduler()
    r = make_request(list(range(8)), max_tokens=4)  # 8 + 4 tokens: 3 blocks of 4
    s.add_request(r)
    step(s)
    computed, usage = r.num_computed_tokens, s.kv_cache_manager.usage
    s.set_pause_state(PauseState.PAUSED_ALL)
    assert not s.has_work() and s.has_unfinished_requests()
    for _ in range(3):
        so, out = step(s)
        assert so.is_empty and out.outputs == []
    assert r.num_computed_tokens == computed and s.kv_cache_manager.usage == usage
    s.set_pause_state(PauseState.UNPAUSED)
    run_until_done(s)
    assert r.num_output_tokens == 4 and s.kv_cache_manager.usage == 0.0


def test_a_request_aborted_while_paused_frees_its_blocks():
    s = make_scheduler()
    kept, queued = make_request(list(range(8))), make_request(list(range(20, 28)))
    s.add_request(kept)
    step(s)
    s.set_pause_state(PauseState.PAUSED_ALL)
    s.add_request(queued)
    step(s)
    s.finish_requests([kept.request_id, queued.request_id], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.usage == 0.0 and not s.has_unfinished_requests()
    s.check_invariants()


def test_a_pinned_jobs_expired_pin_is_not_held_for_its_turn_while_paused():
    # Unpaused, the pin of the job whose turn heads the waiting queue outlives its TTL
    # (the turn is about to take its hit). Paused, that turn is not admitted: a pin held
    # past its deadline would leave the engine a deadline in the past, a step per loop.
    s, policy, clock = setup()
    first = turn("job", list(range(10)))
    s.add_request(first)
    run_until_done(s)
    assert s.make_stats().pin_stats.num_pinned_requests == 1
    s.set_pause_state(PauseState.PAUSED_NEW)
    s.add_request(turn("job", first.all_token_ids + [40], last=True))
    clock.advance(2.1)  # past the pin's TTL (2 s)
    so, _ = step(s)
    assert so.is_empty and s.next_wakeup() is None
    assert policy.released == [(first.request_id, "expired")]
    assert s.kv_cache_manager.usage == 0.0
    s.set_pause_state(PauseState.UNPAUSED)
    run_until_done(s)
    s.check_invariants()
