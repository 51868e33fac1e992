"""Pins on upstream's scheduler: held, hit, expired, released under pressure, aborted,
shut down. Each step ends with the block-pool conservation check (harness.step)."""

from __future__ import annotations

from conftest import make_request
from harness import make_scheduler, run_until_done, step, used_blocks

from vllm.v1.request import RequestStatus


def test_pin_holds_blocks_then_next_turn_hits_them(vllm_config):
    s = make_scheduler(vllm_config)
    clock = s.clock
    # 31 prompt + 2 outputs: the KV of 32 tokens fills 2 full (hashed) blocks.
    t1 = make_request(range(31), job="a")
    s.add_request(t1)
    run_until_done(s)
    assert len(s.pins) == 1 and used_blocks(s) == 2
    clock.advance(1.5)  # the tool runs; the blocks stay
    step(s)
    assert used_blocks(s) == 2
    t2 = make_request([*t1.all_token_ids, 40, 41], job="a", last=True)
    s.add_request(t2)
    so, _ = step(s)
    # The whole pinned context (32 tokens) is a hit: only 35 - 32 = 3 tokens computed.
    assert so.num_scheduled_tokens[t2.request_id] == 3
    assert len(s.pins) == 0 and s.pin_counters.hits == 1
    run_until_done(s)
    assert used_blocks(s) == 0  # the last step frees at once
    assert not s.infos  # each request's view lived until its blocks (or its pin) went


def test_pin_expires_after_its_ttl(vllm_config):
    s = make_scheduler(vllm_config)
    released = []
    s.on_pin_released = lambda e, now, why: released.append(why)
    s.add_request(make_request(range(20), job="a"))
    run_until_done(s)
    s.clock.advance(1.9)
    step(s)
    assert len(s.pins) == 1
    s.clock.advance(0.2)  # past default_ttl_s = 2 s
    step(s)
    assert released == ["expired"] and used_blocks(s) == 0
    assert s.pin_counters.expiries == 1


def test_unnamed_and_last_step_requests_are_not_pinned(vllm_config):
    s = make_scheduler(vllm_config)
    s.add_request(make_request(range(20)))  # no job_id: its own job, nothing can hit
    s.add_request(make_request(range(50, 70), job="b", last=True))
    run_until_done(s)
    assert len(s.pins) == 0 and used_blocks(s) == 0


def test_expired_pin_kept_while_its_turn_is_first_in_line(vllm_config):
    s = make_scheduler(vllm_config, max_num_seqs=1)
    t1 = make_request(range(31), job="a")
    s.add_request(t1)
    run_until_done(s)
    runner = make_request(range(100, 104), max_tokens=20)
    s.add_request(runner)
    step(s)
    t2 = make_request([*t1.all_token_ids, 1], job="a", last=True)
    s.add_request(t2)
    s.clock.advance(5.0)  # past the TTL, but a's turn waits for the only slot
    step(s)
    assert len(s.pins) == 1
    run_until_done(s)
    assert s.pin_counters.hits == 1 and s.pin_counters.expiries == 0


def test_pressure_releases_pins_before_preempting(vllm_config):
    # 8 usable blocks; a pinned job holds 2. A request growing to 8 blocks takes them.
    s = make_scheduler(vllm_config, num_blocks=9)
    s.add_request(make_request(range(31), job="a"))
    run_until_done(s)
    big = make_request(range(100, 140), max_tokens=88)  # 128 tokens = 8 blocks
    s.add_request(big)
    run_until_done(s)
    assert big.num_preemptions == 0 and s.pin_counters.pressure_releases == 1
    assert used_blocks(s) == 0


def test_pressure_releases_the_newest_jobs_pin_first(vllm_config):
    s = make_scheduler(vllm_config, num_blocks=9)
    released = []
    s.on_pin_released = lambda e, now, why: released.append((e.job, why))
    s.add_request(make_request(range(31), job="old"))
    run_until_done(s)
    s.clock.advance(0.1)
    s.add_request(make_request(range(50, 81), job="new"))
    run_until_done(s)  # both pinned: 2 + 2 blocks
    big = make_request(range(100, 140), max_tokens=30)  # grows to 70 tokens = 5 blocks
    s.add_request(big)
    run_until_done(s)
    assert released[0] == ("new", "pressure")
    assert big.num_preemptions == 0


def test_waiting_request_takes_pinned_memory_only_when_allowed(vllm_config):
    s = make_scheduler(vllm_config, num_blocks=9, max_wait_s=10.0)
    s.add_request(make_request(range(31), job="a"))  # pinned: 2 blocks
    run_until_done(s)
    runner = make_request(range(200, 204), max_tokens=40)  # runs long: up to 3 blocks
    s.add_request(runner)
    step(s)
    newcomer = make_request(range(300, 390), max_tokens=2)  # 90 tokens: 6 blocks
    s.add_request(newcomer)
    step(s)  # 8 - 2 pinned - 1 running = 5 free < 6: it waits, the pin stays
    assert newcomer.status == RequestStatus.WAITING and len(s.pins) == 1
    s.clock.advance(11.0)  # starved past max_wait_s (and the TTL passed): it gets in
    run_until_done(s)
    assert newcomer.is_finished() and runner.is_finished() and used_blocks(s) == 0


def test_abort_of_the_turn_a_pin_waits_for_ends_the_pin(vllm_config):
    s = make_scheduler(vllm_config, max_num_seqs=1)
    t1 = make_request(range(31), job="a")
    s.add_request(t1)
    run_until_done(s)
    s.add_request(make_request(range(100, 104), max_tokens=40))
    step(s)
    t2 = make_request([*t1.all_token_ids, 1], job="a")
    s.add_request(t2)
    s.clock.advance(5.0)
    step(s)
    assert len(s.pins) == 1  # kept: its turn is next in line
    s.finish_requests(t2.request_id, RequestStatus.FINISHED_ABORTED)
    step(s)
    assert len(s.pins) == 0 and s.pin_counters.expiries == 1
    run_until_done(s)
    assert used_blocks(s) == 0


def test_aborted_running_turn_is_freed_not_pinned(vllm_config):
    s = make_scheduler(vllm_config)
    r = make_request(range(31), job="a", max_tokens=30)
    s.add_request(r)
    step(s)
    step(s)
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    step(s)
    assert len(s.pins) == 0 and used_blocks(s) == 0


def test_one_pin_per_job_a_newer_turn_replaces_the_older(vllm_config):
    s = make_scheduler(vllm_config)
    s.add_request(make_request(range(20), job="a"))
    s.add_request(make_request(range(50, 70), job="a"))
    run_until_done(s)
    assert len(s.pins) == 1 and s.pin_counters.pins == 2


def test_shutdown_returns_every_pinned_block(vllm_config):
    s = make_scheduler(vllm_config)
    for job in ("a", "b", "c"):
        s.add_request(make_request([ord(job)] * 20, job=job))
    run_until_done(s)
    assert len(s.pins) == 3 and used_blocks(s) > 0
    s.shutdown()
    assert len(s.pins) == 0 and used_blocks(s) == 0
