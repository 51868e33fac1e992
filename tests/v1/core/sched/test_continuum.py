"""Continuum's queue order, TTL decisions, victim choice, and its pins in the scheduler."""

from __future__ import annotations

import pytest

from vllm.config import PolicyConfig, SchedulerConfig, VllmConfig
from vllm.utils.clock import FakeClock
from vllm.v1.core.sched.job_queue import JobRequestQueue
from vllm.v1.core.sched.policy import create_policy, make_request_queue
from vllm_continuum.policy import FREE, Pin, PolicySettings
from vllm_continuum.policy.continuum import ContinuumPolicy

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done, step

BASH_LS = "```bash\nls\n```"


def turn(job, prompt, t, last=False, max_tokens=2, rid=None):
    return make_request(
        prompt, job_id=job, is_last_step=last, arrival_time=t, max_tokens=max_tokens, request_id=rid
    )


def policy(clock=None, decode=lambda ids: BASH_LS, **cfg) -> ContinuumPolicy:
    return ContinuumPolicy(
        PolicySettings(PolicyConfig(**cfg)), decode=decode, clock=clock or FakeClock(0.0)
    )


def queue(p: ContinuumPolicy, clock, pinned) -> JobRequestQueue:
    """The scheduler's wiring: the policy's job order over the pinned jobs' live view."""
    p.bind(pinned)
    q = make_request_queue(p, clock, pinned)
    assert isinstance(q, JobRequestQueue)
    return q


def continuum(clock, **cfg) -> ContinuumPolicy:
    config = VllmConfig(
        scheduler_config=SchedulerConfig(policy="continuum"), policy_config=PolicyConfig(**cfg)
    )
    return create_policy(config, decode=lambda ids: BASH_LS, clock=clock)


def test_queue_orders_by_job_first_arrival_and_pins():
    clock = FakeClock(0.0)
    p = policy(clock)
    pinned: set[str] = set()
    q = queue(p, clock, pinned)
    old_t1 = turn("old", [1], 0.0)
    p.on_arrival(old_t1, 0.0)
    new_t1 = turn("new", [2], 1.0)
    p.on_arrival(new_t1, 1.0)
    q.add_request(new_t1)
    old_t5 = turn("old", [3], 2.0)  # a later turn of the older job
    p.on_arrival(old_t5, 2.0)
    q.add_request(old_t5)
    assert q.peek_request() is old_t5  # turn 5 of an old job beats turn 1 of a new one
    newest = turn("newest", [4], 3.0)
    p.on_arrival(newest, 3.0)
    q.add_request(newest)
    pinned.add("newest")  # a job holding pinned blocks goes first
    q.job_pin_changed("newest")
    assert [r.job_id for r in q] == ["newest", "old", "new"]
    pinned.discard("newest")
    q.job_pin_changed("newest")
    assert q.pop_request() is old_t5 and q.pop_request() is new_t1 and len(q) == 1


def test_queue_bounded_waiting_beats_job_order():
    clock = FakeClock(0.0)
    p = policy(clock, max_wait_s=5.0, job_admission=False)
    q = queue(p, clock, frozenset())
    starving = turn("young", [1], 0.0)
    p.on_arrival(turn("old", [9], -100.0), -100.0)
    p.on_arrival(starving, 0.0)
    q.add_request(starving)
    favoured = turn("old", [2], 1.0)
    q.add_request(favoured)
    assert q.peek_request() is favoured
    clock.advance(6.0)  # the young job's request has now waited > 5 s
    assert q.pop_request() is starving
    q.remove_request(favoured)
    assert not q
    with pytest.raises(IndexError):
        q.peek_request()


def test_queue_many_operations_stay_consistent():
    clock = FakeClock(0.0)
    pinned: set[str] = set()
    q = JobRequestQueue(lambda r: r.arrival_time, clock, lambda r: 1e9, pinned)
    reqs = [turn(f"j{i % 50}", [i + 1], float(i)) for i in range(2000)]
    for r in reqs:
        q.add_request(r)
    for i in range(0, 50, 2):
        pinned.add(f"j{i}")
        q.job_pin_changed(f"j{i}")
    popped = [q.pop_request() for _ in range(len(reqs))]
    assert len({id(r) for r in popped}) == len(reqs)
    pinned_first = [int(r.job_id[1:]) % 2 == 0 for r in popped]
    assert pinned_first == sorted(pinned_first, reverse=True)


def test_victim_is_newest_job_and_last_steps_are_protected():
    p = policy()
    jobs = {}
    for i, job in enumerate(("a", "b", "c")):
        jobs[job] = turn(job, [i + 1], float(i), last=(job == "c"))
        p.on_arrival(jobs[job], float(i))
    running = list(jobs.values())
    assert max(running, key=p.victim_key) is jobs["b"]  # c is newer but on its last step
    assert max([jobs["c"]], key=p.victim_key) is jobs["c"]


def test_cold_start_pins_default_ttl_and_last_step_frees():
    p = policy(default_ttl_s=2.0)
    r = turn("job", [1, 2, 3], 0.0)
    r.append_output_token_ids([5])
    p.on_arrival(r, 0.0)
    assert p.on_finished(r, 1.0) == Pin(2.0)
    last = turn("job", [1, 2, 3, 5, 6], 1.5, last=True)
    last.append_output_token_ids([7])
    p.on_arrival(last, 1.5)
    assert p.on_finished(last, 2.0) is FREE
    jobless = make_request([1, 2])
    jobless.append_output_token_ids([3])
    assert p.on_finished(jobless, 2.0) is FREE


@pytest.mark.parametrize("policy_name", ["continuum", "context_serve"])
def test_a_turn_marked_last_unless_tool_call_ends_the_job_when_it_calls_none(policy_name):
    texts = {"call": BASH_LS, "answer": "The files are main.py and utils.py."}
    config = VllmConfig(scheduler_config=SchedulerConfig(policy=policy_name))
    for kind, text in texts.items():
        p = create_policy(config, decode=lambda ids, text=text: text, clock=FakeClock())
        r = turn("job", [1, 2, 3], 0.0)
        r.sampling_params.extra_args["last_step_unless_tool_call"] = True
        r.append_output_token_ids([5])
        p.on_arrival(r, 0.0)
        action = p.on_finished(r, 1.0)
        assert (action is FREE) == (kind == "answer"), (policy_name, kind, action)


def _learn(p: ContinuumPolicy, tool_text: str, seconds: float, n: int, t0: float) -> float:
    """Run n two-turn jobs whose tool took ``seconds``; returns the clock after."""
    p.decode = lambda ids: tool_text
    t = t0
    for i in range(n):
        job = f"learn-{tool_text[9:12]}-{t0}-{i}"
        r1 = turn(job, [1, 2], t)
        r1.append_output_token_ids([3])
        p.on_arrival(r1, t)
        p.on_finished(r1, t + 0.1)
        r2 = turn(job, [1, 2, 3, 4], t + 0.1 + seconds, last=True)
        r2.append_output_token_ids([5])
        p.on_arrival(r2, t + 0.1 + seconds)
        p.on_finished(r2, t + 0.2 + seconds)
        t += 1.0 + seconds
    return t


def test_paper_rule_pins_fast_tools_and_frees_slow_ones():
    p = policy(min_records=10, max_ttl_s=10.0)
    p.prepare(lambda: [(100, 0.2), (200, 0.4), (400, 0.8)])  # 2 ms per token
    t = _learn(p, "```bash\nls\n```", 0.05, 20, 0.0)
    t = _learn(p, "```bash\npytest\n```", 60.0, 20, t)
    big = turn("fresh", list(range(500)), t)  # re-prefill of 500 tokens costs ~1 s
    big.append_output_token_ids([1])
    p.decode = lambda ids: "```bash\nls\n```"
    p.on_arrival(big, t)
    action = p.on_finished(big, t + 0.1)
    assert isinstance(action, Pin) and action.ttl_s == pytest.approx(0.05)
    slow = turn("fresh2", list(range(500)), t)
    slow.append_output_token_ids([1])
    p.decode = lambda ids: "```bash\npytest\n```"
    p.on_arrival(slow, t)
    assert p.on_finished(slow, t + 0.1) is FREE  # 60 s > max TTL: never worth pinning


def test_fixed_mode_is_the_forks_rule():
    p = policy(continuum_ttl_mode="fixed")
    r = turn("j", [1], 0.0)
    r.append_output_token_ids([2])
    p.on_arrival(r, 0.0)
    assert p.on_finished(r, 0.5) == Pin(2.0)  # unseen tool counts as 0 s
    _learn(p, "```bash\nmake\n```", 5.0, 3, 10.0)
    p.decode = lambda ids: "```bash\nmake\n```"
    r2 = turn("k", [1], 100.0)
    r2.append_output_token_ids([2])
    p.on_arrival(r2, 100.0)
    assert p.on_finished(r2, 100.5) is FREE  # mean 5 s > 2 s
    p.decode = lambda ids: "no tool here"
    r3 = turn("m", [1], 200.0)
    r3.append_output_token_ids([2])
    p.on_arrival(r3, 200.0)
    assert p.on_finished(r3, 200.5) is FREE


def test_continuum_in_the_scheduler_pins_hits_and_frees():
    clock = FakeClock(0.0)
    cont = continuum(clock, default_ttl_s=2.0)
    s = make_scheduler(policy_obj=cont, clock=clock)
    t1 = turn("job", list(range(11)), 0.0)  # KV of 12 tokens = 3 full blocks
    s.add_request(t1)
    run_until_done(s)
    assert len(s.pins) == 1 and s.kv_cache_manager.usage > 0
    clock.advance(1.0)
    t2 = turn("job", t1.all_token_ids + [50, 51], clock.now, last=True)
    s.add_request(t2)
    _, out = step(s)
    assert out.outputs[0].num_cached_tokens == 12 and out.scheduler_stats.pin_stats.pin_hits == 1
    run_until_done(s)
    assert s.kv_cache_manager.usage == 0.0 and len(s.pins) == 0
    s.check_invariants()


def test_job_recorder_writes_timestamps(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("RUN_OUTPUT_DIR", str(tmp_path))
    clock = FakeClock(0.0)
    cont = continuum(clock)
    s = make_scheduler(policy_obj=cont, clock=clock)
    s.add_request(turn("job", list(range(11)), 0.0))
    run_until_done(s)
    s.shutdown()
    events = json.loads((tmp_path / "scheduler_timestamps.json").read_text())["job"]
    kinds = [e["event"] for e in events]
    assert kinds == ["arrival", "scheduled", "departure", "pinned", "unpinned"]
    assert events[2]["func_call"] == "ls" and events[4]["reason"] == "shutdown"
