"""Continuum's job-level admission on upstream's scheduler (vllm_continuum.admission): a
new job's first turn waits while the pool cannot hold it next to the active jobs' needs.

Blocks of 16 tokens; 33 blocks, 32 usable (512 tokens). Job A: turn 1 of 40 prompt
tokens, turn 2 of 72 (the prompt grew by 32 tokens: the learned growth of a turn). Turn 2
ends pinned: 73 computed tokens in 5 blocks, so 27 blocks (432 tokens) are free.
"""

from __future__ import annotations

from conftest import make_request
from harness import make_scheduler, run_until_done, step

from vllm.v1.request import RequestStatus


def start_job_a(s):
    a1 = make_request(range(40), job="A")
    s.add_request(a1)
    run_until_done(s)
    s.clock.advance(0.1)
    a2 = make_request([*a1.all_token_ids, *range(100, 130)], job="A")
    s.add_request(a2)
    run_until_done(s)
    assert "A" in s.pins and s.pins.get("A").num_blocks == 5
    return a2


def test_new_job_waits_until_the_older_job_no_longer_needs_the_memory(vllm_config):
    s = make_scheduler(vllm_config, job_admission=True)
    a2 = start_job_a(s)
    # B's 410 tokens fit the 432 free tokens, but not next to A's next turn (+32): B waits.
    b1 = make_request(range(1000, 1410), job="B")
    s.add_request(b1)
    step(s)
    assert b1.status == RequestStatus.WAITING and not s.running and "A" in s.pins
    s.clock.advance(0.2)
    # A's last turn: 104 tokens, the pinned context's 4 full blocks (64 tokens) a hit; its
    # 7 blocks leave 25 free (400 tokens): B still waits.
    a3 = make_request([*a2.all_token_ids, *[7] * 30], job="A", last=True)
    s.add_request(a3)
    so, _ = step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == [a3.request_id]  # older job first
    assert so.num_scheduled_tokens[a3.request_id] == 40
    run_until_done(s)  # A's last step ends the job: B starts
    assert b1.is_finished()


def test_without_job_admission_the_new_job_takes_the_memory_at_once(vllm_config):
    s = make_scheduler(vllm_config, job_admission=False)
    start_job_a(s)
    b1 = make_request(range(1000, 1410), job="B")
    s.add_request(b1)
    step(s)
    assert b1.status == RequestStatus.RUNNING


def test_new_job_starts_after_the_admission_bound_even_if_memory_is_short(vllm_config):
    s = make_scheduler(
        vllm_config, job_admission=True, job_admission_max_wait_s=5.0, max_wait_s=1.0,
        default_ttl_s=10.0,
    )  # fmt: skip
    start_job_a(s)
    b1 = make_request(range(1000, 1410), job="B")
    s.add_request(b1)
    step(s)
    s.clock.advance(3.0)  # past max_wait_s, not past the admission bound
    step(s)
    assert b1.status == RequestStatus.WAITING and "A" in s.pins
    s.clock.advance(2.1)  # B waited past the admission bound
    step(s)
    assert b1.status == RequestStatus.RUNNING and "A" in s.pins  # it fit beside A's pin


def test_engine_holding_no_job_admits_a_new_job_at_once(vllm_config):
    # A's pin expired and A never came back: nothing runs, nothing is pinned, so B starts
    # at once although A's reservation (its context + growth) would not leave room.
    s = make_scheduler(vllm_config, job_admission=True)
    start_job_a(s)
    s.clock.advance(3.0)
    step(s)  # A's pin expires
    b1 = make_request(range(1000, 1430), job="B")
    s.add_request(b1)
    step(s)
    assert "A" not in s.pins and b1.status == RequestStatus.RUNNING


def test_preempted_and_aborted_turns_leave_the_admission_accounts_balanced(vllm_config):
    # 6 usable blocks, no pins (fixed rule, no tool). x (1 block), then y (2) and z (1)
    # run; z is aborted while running; x grows to 50 tokens (4 blocks) and y to 70 (5):
    # y, the newer job, is preempted and comes back. Afterwards no job counts as running.
    s = make_scheduler(vllm_config, num_blocks=7, text="", continuum_ttl_mode="fixed")
    x = make_request(range(10), job="x", max_tokens=40)
    s.add_request(x)
    step(s)
    s.clock.advance(1.0)
    y = make_request(range(20, 50), job="y", max_tokens=40)
    z = make_request(range(60, 64), job="z", max_tokens=40)
    s.add_request(y)
    s.add_request(z)
    step(s)
    assert z.status == RequestStatus.RUNNING
    s.finish_requests(z.request_id, RequestStatus.FINISHED_ABORTED)
    run_until_done(s)
    assert y.num_preemptions >= 1 and x.num_preemptions == 0
    jobs = s.core.admission._jobs
    assert set(jobs) == {"x", "y", "z"}
    assert all(state.running == 0 for state in jobs.values()), jobs
