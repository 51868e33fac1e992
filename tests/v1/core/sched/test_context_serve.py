"""ContextServe through the scheduler: FAST pinned and hit, SLOW freed for another job,
UNCERTAIN on Continuum's TTL, last steps free; strict pins go last under pressure."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.config import PolicyConfig, SchedulerConfig, VllmConfig
from vllm.utils.clock import FakeClock
from vllm.v1.core.sched.policy import create_policy
from vllm.v1.request import RequestStatus
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.stats import ContextServeStats
from vllm_continuum.pins import PinEntry, PinTable
from vllm_continuum.policy import FREE, Offload, Pin, PolicySettings
from vllm_continuum.policy.context_serve import ContextServePolicy

from ..conftest import make_request
from .helpers import make_scheduler, step


def bash(cmd: str) -> str:
    return f"```bash\n{cmd}\n```"


def turn(job, prompt, t, last=False, max_tokens=2):
    return make_request(
        prompt, job_id=job, is_last_step=last, arrival_time=t, max_tokens=max_tokens
    )


class Totals:
    """Policy stats summed over steps: before the merge step the scheduler does not drain
    ``Policy.make_stats`` into ``SchedulerStats`` (the test then drains it itself)."""

    def __init__(self, policy):
        self.policy = policy
        self.from_scheduler = ContextServeStats()
        self.decisions, self.fast_pin_outcomes = Counter(), Counter()

    def add(self, stats, mine: bool = False):
        if stats is not None:
            self.decisions.update(stats.decisions)
            self.fast_pin_outcomes.update(stats.fast_pin_outcomes)
            if not mine:
                self.from_scheduler.decisions.update(stats.decisions)

    def run(self, s, max_steps: int = 500, clock=None):
        for _ in range(max_steps):
            if not s.has_unfinished_requests():
                return self
            _, out = step(s)
            self.add(out.scheduler_stats.policy_stats)
            if clock is not None:
                clock.advance(1.0)  # time passes: TTLs and waiting bounds end every hold
        raise AssertionError("requests did not finish")

    def drain(self):
        self.add(self.policy.make_stats(), mine=True)
        return self


def build(clock, command: str, name: str = "context_serve", **cfg):
    config = VllmConfig(
        scheduler_config=SchedulerConfig(policy=name), policy_config=PolicyConfig(**cfg)
    )
    policy = create_policy(config, decode=lambda ids: bash(command), clock=clock)
    return policy, make_scheduler(num_blocks=13, policy_obj=policy, clock=clock)


def test_fast_turn_is_pinned_and_hit():
    clock = FakeClock(0.0)
    policy, s = build(clock, "cat setup.py | head -20")
    totals = Totals(policy)
    t1 = turn("job", list(range(11)), 0.0)  # KV of 12 tokens = 3 full blocks
    s.add_request(t1)
    totals.run(s)
    assert len(s.pins) == 1 and s.next_wakeup() == clock.now + 3.0  # fast_pin_s
    clock.advance(2.5)  # the tool returns within the pin
    t2 = turn("job", t1.all_token_ids + [50, 51], clock.now, last=True)
    s.add_request(t2)
    _, out = step(s)
    assert out.outputs[0].num_cached_tokens == 12 and out.scheduler_stats.pin_stats.pin_hits == 1
    totals.add(out.scheduler_stats.policy_stats)
    totals.run(s).drain()
    assert s.kv_cache_manager.usage == 0.0 and len(s.pins) == 0  # the last step frees
    assert totals.decisions == {("fast", "rules"): 1} and totals.fast_pin_outcomes == {"hit": 1}
    s.check_invariants()


def _slow_turn_then_newcomer(name: str):
    # 12 usable blocks of 4 tokens. C decodes for a long time (17 tokens = 5 blocks when A
    # finishes); A's turn holds 3 blocks. Newcomer B needs 5 blocks for its 19-token prompt:
    # it fits only if A's blocks are free (12 - 5 = 7), not while they are pinned (4).
    clock = FakeClock(0.0)
    # (Job-level admission off: its default turn growth does not fit this tiny pool.)
    cmd = "cd /testbed && python -m pytest tests/ -q"
    _, s = build(clock, cmd, name, default_ttl_s=5.0, job_admission=False)
    s.add_request(turn("c", list(range(100, 115)), 0.0, max_tokens=30))
    s.add_request(turn("a", list(range(11)), 0.0))
    for _ in range(2):
        step(s)
    assert [r.job_id for r in s.running] == ["c"]
    clock.advance(0.1)
    b = turn("b", list(range(200, 219)), clock.now, last=True)
    s.add_request(b)
    so, _ = step(s)
    return s, b, so


def test_slow_turn_is_freed_at_once_and_another_job_uses_the_memory():
    s, b, so = _slow_turn_then_newcomer("context_serve")
    assert len(s.pins) == 0
    assert b.request_id in [r.req_id for r in so.scheduled_new_reqs]
    Totals(None).run(s)
    s.check_invariants()
    # Continuum pins the same turn (cold start: its default TTL) and B waits.
    s, b, so = _slow_turn_then_newcomer("continuum")
    assert len(s.pins) == 1 and b.request_id not in [r.req_id for r in so.scheduled_new_reqs]


def test_uncertain_turn_gets_the_continuum_ttl_and_expires():
    clock = FakeClock(0.0)
    policy, s = build(clock, "python reproduce.py", default_ttl_s=2.0)
    s.add_request(turn("job", list(range(11)), 0.0))
    totals = Totals(policy).run(s)
    assert len(s.pins) == 1 and s.next_wakeup() == clock.now + 2.0
    clock.advance(2.1)
    s.schedule()
    assert len(s.pins) == 0 and s.kv_cache_manager.usage == 0.0
    totals.drain()
    assert totals.decisions == {("uncertain", "fallback"): 1} and not totals.fast_pin_outcomes
    s.check_invariants()


def test_last_steps_and_slow_turns_are_never_pinned():
    clock = FakeClock(0.0)
    p = ContextServePolicy(PolicySettings(), decode=lambda ids: bash("ls"), clock=clock)
    last = turn("j", [1, 2, 3], 0.0, last=True)
    last.append_output_token_ids([4])
    p.on_arrival(last, 0.0)
    assert p.on_finished(last, 0.5) is FREE
    r = turn("k", [1, 2, 3], 1.0)
    r.append_output_token_ids([4])
    p.on_arrival(r, 1.0)
    assert p.on_finished(r, 1.5) == Pin(3.0, strict=True)
    p.decode = lambda ids: bash("npm install")
    assert p.on_finished(r, 2.0) == Offload()  # to the CPU tier if any (else freed)
    dropping = ContextServePolicy(
        PolicySettings(context_serve=ContextServeConfig(offload_slow=False)),
        decode=lambda ids: bash("npm install"),
        clock=clock,
    )
    assert dropping.on_finished(r, 2.0) is FREE


def _entry(job: str, arrival: float, strict: bool) -> PinEntry:
    return PinEntry(
        turn(job, [1], arrival),
        arrival + 5.0,
        arrival,
        job_arrival=arrival,
        num_blocks=1,
        strict=strict,
    )


def test_pressure_releases_soft_pins_before_strict_ones():
    pins = PinTable()
    pins.add("old-soft", _entry("old-soft", 0.0, strict=False))
    pins.add("new-strict", _entry("new-strict", 2.0, strict=True))
    pins.add("mid-soft", _entry("mid-soft", 1.0, strict=False))
    order = []
    while (job := pins.newest_job()) is not None:
        order.append(job)
        pins.remove(job)
    assert order == ["mid-soft", "old-soft", "new-strict"]  # newest soft first, strict last
    pins.add("a", _entry("a", 0.0, strict=True))
    pins.add("b", _entry("b", 1.0, strict=True))
    assert pins.newest_job(exclude="b") == "a" and pins.newest_job() == "b"


def test_scheduler_places_strict_pins():
    clock = FakeClock(0.0)
    policy, s = build(clock, "ls")
    s.add_request(turn("job", list(range(11)), 0.0))
    Totals(policy).run(s)
    assert s.pins.pinned.get("job").strict


def test_scheduler_stats_carry_the_policy_stats():
    clock = FakeClock(0.0)
    policy, s = build(clock, "ls")
    s.add_request(turn("job", list(range(11)), 0.0))
    totals = Totals(policy).run(s)
    assert totals.from_scheduler.decisions == {("fast", "rules"): 1}


COMMANDS = ["ls -la", "make -j4", "python x.py", "no tool call"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "step", "step", "abort", "tick"]), st.integers(0, 50)),
        min_size=1,
        max_size=50,
    )
)
def test_random_agent_workload_conserves_blocks(seq):
    clock = FakeClock(0.0)
    config = VllmConfig(
        scheduler_config=SchedulerConfig(policy="context_serve"),
        policy_config=PolicyConfig(default_ttl_s=1.0),
    )
    policy = create_policy(config, decode=lambda ids: bash(COMMANDS[ids[-1] % 4]), clock=clock)
    s = make_scheduler(num_blocks=10, budget=16, max_num_seqs=4, max_model_len=40,
                       policy_obj=policy, clock=clock)  # fmt: skip
    added = []
    for op, arg in seq:
        if op == "add":
            req = turn(f"job{arg % 3}", [arg + i for i in range(1 + arg % 20)], clock.now,
                       last=arg % 4 == 0, max_tokens=1 + arg % 9)  # fmt: skip
            s.add_request(req)
            added.append(req)
        elif op == "step":
            step(s, token=arg)  # the token picks the turn's command
        elif op == "abort" and added:
            s.finish_requests(added[arg % len(added)].request_id, RequestStatus.FINISHED_ABORTED)
        elif op == "tick":
            clock.advance(arg / 10)
        s.check_invariants()
    Totals(policy).run(s, clock=clock)
    clock.advance(10)
    s.schedule()  # every pin has expired
    s.check_invariants()
    assert s.kv_cache_manager.usage == 0.0 and len(s.pins) == 0
