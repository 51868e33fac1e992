"""Continuum's job-level admission and pressure rules through the scheduler (issue 11).

Blocks of 4 tokens; a 33-block pool has 32 usable blocks (128 tokens). Every turn's
output is a ```bash``` block, so Continuum pins each non-last turn (2 s at cold start).
"""

from __future__ import annotations

from vllm.config import PolicyConfig, SchedulerConfig, VllmConfig
from vllm.utils.clock import FakeClock
from vllm.v1.core.sched.policy import create_policy
from vllm.v1.request import RequestStatus

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done, step


def continuum(clock, **cfg):
    config = VllmConfig(
        scheduler_config=SchedulerConfig(policy="continuum"), policy_config=PolicyConfig(**cfg)
    )
    return create_policy(config, decode=lambda ids: "```bash\nls\n```", clock=clock)


def setup(num_blocks=33, max_num_seqs=16, **cfg):
    clock = FakeClock(0.0)
    cfg.setdefault("job_idle_timeout_s", 100.0)
    cfg.setdefault("job_admission", True)  # opt-in (off by default)
    s = make_scheduler(
        num_blocks=num_blocks, max_num_seqs=max_num_seqs, policy_obj=continuum(clock, **cfg),
        clock=clock,
    )  # fmt: skip
    return s, clock


def turn(job, prompt, clock, last=False, max_tokens=2):
    return make_request(
        prompt, job_id=job, is_last_step=last, arrival_time=clock.now, max_tokens=max_tokens
    )


def start_job_a(s, clock):
    """Job A: turn 1 (20 tokens) then turn 2 (32 tokens: the prompt grew by 12). Ends
    pinned, holding 34 tokens in 9 blocks."""
    a1 = turn("A", list(range(20)), clock)
    s.add_request(a1)
    run_until_done(s)
    clock.advance(0.1)
    a2 = turn("A", a1.all_token_ids + list(range(100, 110)), clock)
    s.add_request(a2)
    run_until_done(s)
    assert a2.num_cached_tokens == 20 and "A" in s.pins
    return a2


def test_new_job_waits_until_the_older_job_no_longer_needs_the_memory():
    s, clock = setup()
    a2 = start_job_a(s, clock)
    # 23 free blocks = 92 tokens; A's next turn will grow by ~12 tokens. B's 84-token
    # first turn fits the free blocks (21), but not next to A's growth: it waits.
    b1 = turn("B", list(range(1000, 1084)), clock)
    s.add_request(b1)
    step(s)
    assert b1.status == RequestStatus.WAITING and not s.running
    clock.advance(0.2)
    a3 = turn("A", a2.all_token_ids + [7, 7, 7, 7, 7, 7], clock, last=True)
    s.add_request(a3)
    so, _ = step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == [a3.request_id]  # older job first
    run_until_done(s)  # A's last step ends the job: B starts
    assert b1.is_finished() and len(s.pins) == 1
    s.check_invariants()


def test_without_job_admission_the_new_job_takes_the_memory_at_once():
    s, clock = setup(job_admission=False)
    start_job_a(s, clock)
    b1 = turn("B", list(range(1000, 1084)), clock)
    s.add_request(b1)
    step(s)
    assert b1.status == RequestStatus.RUNNING


def test_new_job_starts_after_the_admission_bound_even_if_memory_is_short():
    s, clock = setup(job_admission_max_wait_s=5.0, max_wait_s=1.0, default_ttl_s=10.0)
    start_job_a(s, clock)
    b1 = turn("B", list(range(1000, 1084)), clock)
    s.add_request(b1)
    step(s)
    clock.advance(3.0)
    step(s)
    assert b1.status == RequestStatus.WAITING and "A" in s.pins
    clock.advance(2.1)  # B waited past the admission bound
    step(s)
    assert b1.status == RequestStatus.RUNNING and "A" in s.pins  # it fit beside A's pin


def test_engine_holding_no_job_admits_a_new_job_at_once():
    # The soak's stall: A's pin expired and A never came back. Nothing runs and nothing is
    # pinned, so B starts at once instead of waiting for A's reservation to lapse.
    s, clock = setup(job_admission_max_wait_s=300.0)
    start_job_a(s, clock)
    clock.advance(3.0)
    s.schedule()  # A's pin expires
    b1 = turn("B", list(range(1000, 1120)), clock)  # 120 tokens: more than A's reserve allows
    s.add_request(b1)
    step(s)
    assert "A" not in s.pins and b1.status == RequestStatus.RUNNING


def c_expected_back_and_a_pinned():
    """C ran one turn and its 2 s pin expired, but C is expected back within max_ttl_s, so
    its context stays in the admission reserve; then job A's first turn ends pinned."""
    s, clock = setup(default_ttl_s=2.0, max_ttl_s=10.0)
    c1 = turn("C", list(range(300, 320)), clock)
    s.add_request(c1)
    run_until_done(s)
    clock.advance(2.5)
    s.schedule()  # C's pin expires
    assert "C" not in s.pins
    return s, clock, start_job_a(s, clock)


def test_while_nothing_runs_a_new_job_needs_room_only_beside_the_pinned_jobs_growth():
    # Work-conserving admission. C is expected back, A is pinned. B's 60-token first turn
    # fits beside A's pin and growth, not beside C's context too. With A or C running it
    # would wait; with nothing running the engine would idle, so B starts.
    s, clock, _ = c_expected_back_and_a_pinned()
    free = s.kv_cache_manager.num_free_blocks * 4
    core = s.policy.core
    assert 60 + core.admission.turn_growth <= free
    assert 60 + core.admission.reserve_tokens({"A"}, clock.now) > free  # the old rule
    b1 = turn("B", list(range(1000, 1060)), clock)
    s.add_request(b1)
    step(s)
    assert b1.status == RequestStatus.RUNNING and "A" in s.pins
    run_until_done(s)
    s.check_invariants()


def test_while_an_older_job_runs_the_new_job_waits_for_the_full_reserve():
    s, clock, a2 = c_expected_back_and_a_pinned()
    a3 = turn("A", a2.all_token_ids + [7, 7, 7, 7], clock, max_tokens=8)
    s.add_request(a3)
    step(s)  # A's turn runs
    b1 = turn("B", list(range(1000, 1060)), clock)
    s.add_request(b1)
    step(s)
    assert a3.status == RequestStatus.RUNNING and b1.status == RequestStatus.WAITING
    run_until_done(s)
    assert b1.is_finished()
    s.check_invariants()


def test_new_job_starts_at_once_when_no_older_job_is_active():
    s, clock = setup()
    b1 = turn("B", list(range(100)), clock)
    s.add_request(b1)
    step(s)
    assert b1.status == RequestStatus.RUNNING


def test_a_newer_jobs_turn_does_not_tear_down_an_older_jobs_pin():
    # 17 blocks: A holds 9 pinned; B (started earlier, newer than A) sends a 40-token
    # turn: 10 blocks > 7 free. It waits for A instead of releasing A's pin.
    s, clock = setup(num_blocks=18)
    start_job_a(s, clock)
    b1 = turn("B", [500], clock)
    s.add_request(b1)
    run_until_done(s)  # B is a started job now (pinned: 1 block)
    clock.advance(0.1)
    b2 = turn("B", b1.all_token_ids + list(range(600, 637)), clock)
    s.add_request(b2)
    step(s)
    assert b2.status == RequestStatus.WAITING and "A" in s.pins
    a3 = turn("A", s.pins.pinned.get("A").request.all_token_ids + [1], clock, last=True)
    s.add_request(a3)  # the older job's turn releases the newer job's pin if it must
    run_until_done(s)
    assert a3.num_cached_tokens >= 32 and b2.is_finished()
    s.check_invariants()


def test_running_turn_of_a_newer_job_alone_waits_for_an_older_pin_instead_of_capping():
    # 14 blocks (52 tokens usable): A pins 9 blocks. B's turn (4 tokens + 30 output) fits
    # next to A's growth at first, but cannot grow past the 4 free blocks without A's pin:
    # it is preempted (not length-capped) and finishes once A's pin has expired.
    s, clock = setup(num_blocks=14)
    start_job_a(s, clock)
    b1 = turn("B", list(range(500, 504)), clock, last=True, max_tokens=30)
    s.add_request(b1)
    for _ in range(20):
        step(s)
        if b1.status != RequestStatus.RUNNING:
            break
    assert b1.status == RequestStatus.PREEMPTED and "A" in s.pins
    assert b1.num_output_tokens == 13  # the 17th token needs a 5th block
    clock.advance(3.0)  # A's pin expires; B resumes and finishes its 30 tokens
    run_until_done(s)
    assert b1.is_finished() and b1.num_output_tokens == 30
    s.check_invariants()
