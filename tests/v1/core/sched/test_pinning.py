"""The pin mechanism, driven by a minimal policy that pins every non-last turn for 2 s."""

from __future__ import annotations

from vllm.utils.clock import FakeClock
from vllm.v1.request import RequestStatus
from vllm_continuum.policy.base import FREE, Pin
from vllm_continuum.policy.plain import FCFSPolicy

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done, step


class PinAll(FCFSPolicy):
    def __init__(self, ttl: float = 2.0):
        super().__init__()
        self.ttl = ttl
        self.released: list[tuple[str, str]] = []

    def on_finished(self, request, now):
        return FREE if request.is_last_step else Pin(self.ttl)

    def on_pin_released(self, request, now, reason):
        self.released.append((request.request_id, reason))


def turn(job: str, prompt: list[int], last: bool = False, max_tokens: int = 2):
    return make_request(prompt, job_id=job, is_last_step=last, max_tokens=max_tokens)


def setup(num_blocks: int = 33, **kw):
    clock = FakeClock(start=0.0)  # requests built by make_request arrive at t=0
    policy = PinAll()
    return (
        make_scheduler(num_blocks=num_blocks, policy_obj=policy, clock=clock, **kw),
        policy,
        clock,
    )


def test_pin_keeps_blocks_until_ttl_expires():
    s, policy, clock = setup()
    r = turn("job", list(range(10)))  # 10 + 2 outputs = 12 tokens = 3 blocks
    s.add_request(r)
    run_until_done(s)
    usage = s.kv_cache_manager.usage
    assert usage > 0 and s.make_stats().pin_stats.num_pinned_requests == 1
    assert not s.has_unfinished_requests() and s.next_wakeup() == clock.now + 2.0
    clock.advance(1.9)
    s.schedule()
    assert s.kv_cache_manager.usage == usage  # still pinned
    clock.advance(0.2)
    s.schedule()
    assert s.kv_cache_manager.usage == 0.0
    assert policy.released == [(r.request_id, "expired")]
    assert s.make_stats().pin_stats.num_pinned_requests == 0
    s.check_invariants()


def test_without_prefix_caching_a_pin_frees_at_once():
    """No later request can hit a block without prefix caching (a model with
    linear-attention layers runs so): the policy's pin is a free, held by nobody."""
    s, policy, clock = setup(prefix_caching=False)
    r = turn("job", list(range(10)))
    s.add_request(r)
    run_until_done(s)
    assert s.kv_cache_manager.usage == 0.0
    assert s.make_stats().pin_stats.num_pinned_requests == 0 and s.next_wakeup() is None
    t2 = turn("job", r.all_token_ids + [40], last=True)
    s.add_request(t2)
    _, out = step(s)
    assert out.outputs[0].num_cached_tokens == 0
    run_until_done(s)
    assert policy.released == [] and s.kv_cache_manager.usage == 0.0
    s.check_invariants()


def test_next_turn_hits_pinned_blocks_and_releases_pin():
    s, policy, clock = setup()
    # 11 prompt + 2 outputs: the KV of 12 tokens (the last sampled token is never computed)
    # fills 3 blocks, all full and hashed.
    t1 = turn("job", list(range(11)))
    s.add_request(t1)
    run_until_done(s)
    context = t1.all_token_ids  # 13 tokens
    clock.advance(1.0)
    t2 = turn("job", context + [40, 41], last=True)
    s.add_request(t2)
    so, out = step(s)
    # All 3 pinned blocks (12 tokens) are a prefix hit; only 15 - 12 = 3 tokens computed.
    assert out.outputs[0].num_cached_tokens == 12
    assert so.num_scheduled_tokens[t2.request_id] == 3
    assert policy.released == [(t1.request_id, "hit")]
    stats = out.scheduler_stats.pin_stats  # deltas of this step
    assert stats.pin_hits == 1 and stats.num_pinned_requests == 0
    run_until_done(s)
    assert s.kv_cache_manager.usage == 0.0  # the last step frees at once


def test_expired_pin_kept_while_job_has_waiting_request():
    # max_num_seqs=1 and a long-running other request keep the job's next turn waiting.
    s, policy, clock = setup(max_num_seqs=1)
    t1 = turn("job", list(range(11)))  # KV of 12 tokens = 3 full blocks
    s.add_request(t1)
    run_until_done(s)
    other = make_request(list(range(100, 104)), max_tokens=20)
    s.add_request(other)
    step(s)
    t2 = turn("job", t1.all_token_ids + [1], last=True)
    s.add_request(t2)
    clock.advance(5.0)  # past the TTL, but t2 waits: the pin must survive
    step(s)
    assert policy.released == []
    run_until_done(s)
    assert policy.released == [(t1.request_id, "hit")]
    assert t2.num_cached_tokens == 12


def test_pressure_releases_pins_before_preempting():
    # 8 usable blocks; a pinned job holds 3. A running request that needs all 8 makes the
    # scheduler drop the pin instead of preempting anyone.
    s, policy, clock = setup(num_blocks=9)
    t1 = turn("job", list(range(10)))
    s.add_request(t1)
    run_until_done(s)
    big = make_request(list(range(100, 120)), max_tokens=12)  # grows to 32 tokens = 8 blocks
    s.add_request(big)
    run_until_done(s)
    assert (t1.request_id, "pressure") in policy.released
    assert big.num_preemptions == 0
    assert s.make_stats().num_preemptions == 0


def test_waiting_request_takes_pinned_memory_only_when_idle_or_starved():
    s, policy, clock = setup(num_blocks=9, max_wait_s=10.0)
    t1 = turn("job-a", list(range(10)))  # pinned: 3 blocks
    s.add_request(t1)
    run_until_done(s)
    runner = make_request(list(range(200, 204)), max_tokens=20)  # runs long: up to 6 blocks
    s.add_request(runner)
    step(s)
    newcomer = make_request(list(range(300, 316)), max_tokens=2)  # 16 tokens = 4 blocks + 1
    s.add_request(newcomer)
    # 8 - 3 pinned - 2 running = 3 free < 4 needed: it waits, the pin stays (work flows).
    step(s)
    assert newcomer.status.name == "WAITING" and policy.released == []
    clock.advance(11.0)  # starved past max_wait_s: the pin gives way
    # (the TTL passed too, so the pin may simply expire; either way nothing deadlocks)
    run_until_done(s)
    assert newcomer.is_finished() and runner.is_finished()
    s.check_invariants()


def test_one_pin_per_job_newer_replaces_older():
    s, policy, clock = setup(max_num_seqs=2)
    a1 = turn("job", list(range(10)))
    a2 = turn("job", list(range(50, 60)))  # concurrent request of the same job
    s.add_request(a1)
    s.add_request(a2)
    run_until_done(s)
    assert s.make_stats().pin_stats.num_pinned_requests == 1
    assert any(reason == "replaced" for _, reason in policy.released)
    s.check_invariants()


def test_shutdown_releases_all_pins():
    s, policy, clock = setup()
    for job in ("a", "b"):
        s.add_request(turn(job, list(range(5)) + [ord(job)]))
    run_until_done(s)
    assert s.kv_cache_manager.usage > 0
    s.shutdown()
    assert s.kv_cache_manager.usage == 0.0
    s.check_invariants()


def test_sequence_outgrowing_the_whole_cache_is_length_capped_not_livelocked():
    s, policy, clock = setup(num_blocks=5)  # 4 usable blocks = 16 tokens
    r = make_request(list(range(10)), max_tokens=40)
    s.add_request(r)
    _, last = step(s)
    for _ in range(30):
        if not s.has_unfinished_requests():
            break
        _, last = step(s)
    # 16 slots hold the KV of 16 tokens; the 17th was sampled and needs no KV.
    assert r.status.name == "FINISHED_LENGTH_CAPPED" and r.num_tokens == 17
    assert str(last.outputs[-1].finish_reason) == "length"
    s.check_invariants()


def test_expired_pins_of_jobs_stuck_behind_others_are_released():
    # Two pinned jobs both have their next turn waiting (one seq slot, busy). Once the TTL
    # passed, only the job first in line keeps its pin; holding both would let pinned
    # memory starve the queue (the deadlock seen with a full pool before this rule).
    s, policy, clock = setup(max_num_seqs=1)
    a1, b1 = turn("a", list(range(11))), turn("b", list(range(50, 61)))
    for r in (a1, b1):
        s.add_request(r)
    run_until_done(s)
    runner = make_request(list(range(100, 104)), max_tokens=30)
    s.add_request(runner)
    step(s)
    a2 = turn("a", a1.all_token_ids + [1], last=True)
    b2 = turn("b", b1.all_token_ids + [2], last=True)
    s.add_request(a2)
    s.add_request(b2)
    clock.advance(3.0)
    step(s)
    assert (b1.request_id, "expired") in policy.released
    assert all(rid != a1.request_id for rid, _ in policy.released)
    run_until_done(s)
    assert a2.num_cached_tokens == 12  # a kept its pin and took its hit
    s.check_invariants()


def test_pin_kept_for_a_waiting_turn_ends_when_that_turn_is_aborted():
    # The leak of issue 16: job's turn 2 waits (one seq slot, busy) past the TTL, so the
    # expired pin is kept for it; then its client leaves (abort). The pin must still end
    # at the next step, not when the job happens to send another turn.
    s, policy, clock = setup(max_num_seqs=1)
    t1 = turn("job", list(range(11)))
    s.add_request(t1)
    run_until_done(s)
    other = make_request(list(range(100, 104)), max_tokens=40, job_id="o", is_last_step=True)
    s.add_request(other)
    step(s)
    t2 = turn("job", t1.all_token_ids + [1])
    s.add_request(t2)
    clock.advance(5.0)
    step(s)
    assert policy.released == [] and len(s.pins) == 1  # kept: its turn is next in line
    s.finish_requests(t2.request_id, RequestStatus.FINISHED_ABORTED)
    step(s)
    assert policy.released == [(t1.request_id, "expired")] and len(s.pins) == 0
    assert s.next_wakeup() is None
    run_until_done(s)
    assert s.kv_cache_manager.usage == 0.0


def test_request_stopped_by_the_front_end_goes_through_the_policy():
    # A stop string is seen by the front end's detokenizer, which tells the engine to
    # finish the request as stopped: the policy pins it like an EOS (issue 16).
    s, policy, clock = setup()
    t1 = turn("job", list(range(11)), max_tokens=30)
    s.add_request(t1)
    step(s)
    step(s)
    s.finish_requests(t1.request_id, RequestStatus.FINISHED_STOPPED)
    assert t1.status == RequestStatus.FINISHED_STOPPED and len(s.pins) == 1
    assert t1.request_id in s.schedule().finished_req_ids
    s.check_invariants()
    waiting = turn("other", [90, 91], max_tokens=30)
    s.add_request(waiting)  # a waiting (never run) request told to stop is just freed
    s.finish_requests(waiting.request_id, RequestStatus.FINISHED_STOPPED)
    assert len(s.pins) == 1 and not s.has_unfinished_requests()
    clock.advance(3.0)
    s.schedule()
    assert policy.released == [(t1.request_id, "expired")]
    assert s.kv_cache_manager.usage == 0.0
