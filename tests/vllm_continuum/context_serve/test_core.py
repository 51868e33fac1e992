"""ContextServeCore with a fake clock: the three-way dispatch, learning from measured tool
times, the scores of its verdicts, the recorder, config validation, bad input."""

from __future__ import annotations

import json
import logging

import pytest

from vllm.config import PolicyConfig
from vllm_continuum.clock import FakeClock
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.core import ContextServeCore
from vllm_continuum.context_serve.types import ToolSpeed
from vllm_continuum.turns import FinishedTurn


def bash(cmd: str) -> str:
    return f"I will run it.\n```bash\n{cmd}\n```"


def core(clock=None, policy=None, **cs) -> ContextServeCore:
    config = ContextServeConfig(**cs)
    return ContextServeCore(policy or PolicyConfig(), clock or FakeClock(0.0), config)


def finish(c: ContextServeCore, job: str, text: str | None, now: float, last: bool = False):
    c.on_arrival(job, f"{job}-{now}", now - 0.5, named=True, prompt_tokens=90)
    turn = FinishedTurn(job, f"{job}-{now}", now, text, last, named=True, num_tokens=100)
    return c.decide(turn)


def test_fast_is_a_strict_pin_slow_frees_uncertain_gets_the_continuum_ttl():
    c = core(policy=PolicyConfig(default_ttl_s=1.5, max_ttl_s=10.0), fast_pin_s=3.0)
    fast = finish(c, "a", bash("ls -la"), 1.0)
    assert (fast.speed, fast.ttl_s, fast.strict) == (ToolSpeed.FAST, 3.0, True)
    slow = finish(c, "b", bash("cd /testbed && pytest tests/"), 1.0)
    assert (slow.speed, slow.ttl_s, slow.offload) == (ToolSpeed.SLOW, 0.0, True)
    unsure = finish(c, "c", bash("python reproduce.py"), 1.0)
    assert (unsure.speed, unsure.ttl_s, unsure.strict) == (ToolSpeed.UNCERTAIN, 1.5, False)
    last = finish(c, "d", bash("ls"), 1.0, last=True)
    assert last.ttl_s == 0 and not last.offload
    jobless = c.decide(FinishedTurn("req-x", "req-x", 1.0, bash("ls"), False, False, 9))
    assert jobless.ttl_s == 0
    assert c.on_finished(FinishedTurn("e", "e-1", 2.0, bash("ls"), False, True, 10)) == 3.0
    stats = c.make_stats()
    assert stats.decisions == {("fast", "rules"): 2, ("slow", "rules"): 1,
                               ("uncertain", "fallback"): 1}  # fmt: skip
    assert not c.make_stats().decisions  # deltas


def test_fast_pin_is_capped_and_slow_offloads_when_a_tier_exists():
    c = core(policy=PolicyConfig(max_ttl_s=1.0), fast_pin_s=3.0, offload_slow=True)
    assert finish(c, "a", bash("cat x"), 1.0).ttl_s == 1.0
    assert finish(c, "b", bash("make"), 1.0).offload
    nopin = core(policy=PolicyConfig(max_ttl_s=0.0))
    assert finish(nopin, "a", bash("ls"), 1.0).ttl_s == 0.0


@pytest.mark.parametrize(
    "text",
    [None, "", "no tool call here", "```bash\n\n```", '{"tool_calls": [{"function": 3}]}',
     "```bash\necho 'unbalanced\n```", "<tool_call>{not json}</tool_call>", "\x00\xff" * 50],
)  # fmt: skip
def test_unparsable_outputs_are_uncertain_never_an_exception(text):
    d = finish(core(), "j", text, 1.0)
    assert d.speed in (ToolSpeed.UNCERTAIN, ToolSpeed.FAST)  # "echo 'unbalanced" is echo


def test_learns_tool_times_and_scores_its_verdicts():
    clock = FakeClock(0.0)
    c = core(clock, min_observations=3)
    t = 0.0
    for i in range(3):  # "python reproduce.py" takes 0.2 s: unknown to the rules
        c.decide(FinishedTurn(f"j{i}", "r", t, bash("python reproduce.py"), False, True, 10))
        c.on_arrival(f"j{i}", "r2", t + 0.2, True, 90)
        t += 1.0
    d = c.decide(FinishedTurn("k", "r", t, bash("python reproduce.py"), False, True, 10))
    assert d.speed == ToolSpeed.FAST and d.strict and 0.2 < d.ttl_s < 2.0
    c.on_pin_released("k", "r", "hit")
    c.on_arrival("k", "r2", t + 0.25, True, 90)
    stats = c.make_stats()
    assert stats.decisions[("fast", "bayes")] == 1 and stats.fast_pin_outcomes == {"hit": 1}
    assert stats.prediction_errors_s == [pytest.approx(abs(0.25 - 0.2), abs=0.02)]
    # Regret: a rule-SLOW tool that came back fast; a FAST pin the tool outlived.
    c.decide(FinishedTurn("s", "rs", t, bash("make"), False, True, 10))
    c.on_arrival("s", "rs2", t + 0.1, True, 90)
    c.decide(FinishedTurn("f", "rf", t, bash("ls"), False, True, 10))
    c.on_pin_released("f", "rf", "expired")
    c.on_arrival("f", "rf2", t + 30.0, True, 90)
    stats = c.make_stats()
    assert stats.regret == {"slow_was_fast": 1, "fast_was_slow": 1}
    assert stats.fast_pin_outcomes == {"expired": 1}


def test_decision_log_and_recorder_fields(tmp_path, caplog):
    no_tier = ContextServeConfig(offload_slow=False)
    c = ContextServeCore(PolicyConfig(), FakeClock(0.0), no_tier, record_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="vllm_continuum"):
        finish(c, "job9", bash("pip install -e ."), 1.0)
    assert "job 'job9': func_call=pip install -> SLOW (rules) free" in caplog.text
    finish(c, "job9", bash("ls"), 2.0)
    c.shutdown()
    events = json.loads((tmp_path / "scheduler_timestamps.json").read_text())["job9"]
    departures = [e for e in events if e["event"] == "departure"]
    assert departures[0]["speed"] == "slow" and departures[0]["layer"] == "rules"
    assert departures[0]["command"] == "pip install -e ." and departures[0]["ttl_s"] == 0
    assert departures[1]["speed"] == "fast" and events[-1] == {
        **events[-1], "event": "pinned", "strict": True}  # fmt: skip


def test_a_predictor_bug_is_uncertain(monkeypatch):
    c = core()

    def broken(*args):
        raise RuntimeError("bug")

    monkeypatch.setattr(c.predictor.bayes, "predict", broken)
    assert finish(c, "j", bash("python x.py"), 1.0).speed == ToolSpeed.UNCERTAIN


@pytest.mark.parametrize(
    ("field", "value"),
    [("fast_threshold_s", 0), ("fast_confidence", 1.0), ("slow_confidence", 0.2),
     ("ttl_quantile", 1.5), ("min_observations", 0), ("prior_beta", -1.0),
     ("max_train_samples", 3), ("rules", ""), ("xgb_rounds", 0)],
)  # fmt: skip
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ContextServeConfig(**{field: value})


def test_unreadable_files_fail_at_start_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match="^rules must name a readable file"):
        ContextServeConfig(rules=str(tmp_path / "nope.yaml"))
    with pytest.raises(ValueError, match="^model must name a readable file"):
        ContextServeConfig(model=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match="context_serve rules: cannot read"):
        core(rules=str(bad))
    with pytest.raises(ValueError, match="context_serve model: cannot load"):
        core(model=str(bad))
