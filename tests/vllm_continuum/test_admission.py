"""JobAdmission's accounting: reserves for held and not-held jobs, growth, idle expiry."""

from __future__ import annotations

from vllm_continuum.admission import DEFAULT_TURN_GROWTH, JobAdmission


def test_reserve_counts_whole_context_only_for_jobs_whose_kv_is_not_held():
    adm = JobAdmission(idle_timeout_s=100.0)
    adm.on_scheduled("a", 300, now=0.0)  # running: holds its KV
    adm.on_scheduled("b", 200, now=0.0)
    adm.on_stopped(
        "b", 220, is_last_step=False, now=1.0, reserve_s=10.0
    )  # b in a tool gap, unpinned
    g = DEFAULT_TURN_GROWTH
    assert adm.reserve_tokens(pinned_jobs=set(), now=1.0) == g + (220 + g)
    assert adm.reserve_tokens(pinned_jobs={"b"}, now=1.0) == g + g  # b's KV is pinned
    assert adm.admits(100, free_tokens=220 + 2 * g + 100, pinned_jobs=set(), now=1.0)
    assert not adm.admits(101, free_tokens=220 + 2 * g + 100, pinned_jobs=set(), now=1.0)


def test_growth_is_learned_from_consecutive_turns_and_last_step_ends_the_job():
    adm = JobAdmission(idle_timeout_s=100.0)
    adm.on_scheduled("a", 100, now=0.0)
    adm.on_stopped("a", 120, is_last_step=False, now=1.0, reserve_s=10.0)
    adm.on_arrival("a", 400, now=2.0)  # the tool's output grew the prompt by 300
    adm.on_arrival("new", 50, now=2.0)  # unknown jobs are not active before admission
    assert adm.turn_growth == 300 and adm.is_known("a") and not adm.is_known("new")
    assert adm.reserve_tokens(set(), now=2.0) == 400 + 300  # waiting: not held
    adm.on_scheduled("a", 400, now=2.5)
    adm.on_stopped("a", 430, is_last_step=True, now=3.0, reserve_s=10.0)
    assert not adm.is_known("a") and adm.reserve_tokens(set(), now=3.0) == 0


def test_silent_jobs_stop_counting_after_the_idle_timeout_but_running_ones_never():
    adm = JobAdmission(idle_timeout_s=10.0)
    adm.on_scheduled("gone", 500, now=0.0)
    adm.on_stopped("gone", 520, is_last_step=False, now=1.0, reserve_s=10.0)
    adm.on_scheduled("busy", 100, now=0.0)
    assert adm.reserve_tokens(set(), now=11.0) > 520
    assert adm.reserve_tokens(set(), now=11.5) == DEFAULT_TURN_GROWTH  # only "busy" left
    assert not adm.is_known("gone") and adm.is_known("busy")


def test_a_job_expected_back_late_reserves_nothing_until_its_turn_arrives():
    adm = JobAdmission(idle_timeout_s=100.0)
    adm.on_scheduled("a", 300, now=0.0)
    adm.on_stopped("a", 320, is_last_step=False, now=1.0, reserve_s=10.0)
    assert adm.reserve_tokens(set(), now=11.0) == 320 + DEFAULT_TURN_GROWTH
    assert adm.reserve_tokens(set(), now=11.5) == 0  # past the horizon: not expected soon
    adm.expect_late("a", now=11.5)
    adm.on_arrival("a", 400, now=30.0)  # back: its turn waits, its context is needed
    assert adm.reserve_tokens(set(), now=30.0) == 400 + 100


def test_per_job_log_lines_escape_the_job_and_follow_the_switch(caplog):
    import logging

    from vllm_continuum.clock import FakeClock
    from vllm_continuum.config import PolicyConfig
    from vllm_continuum.continuum import ContinuumCore

    forged = "a\nINFO forged line"
    for log_jobs, level in ((True, logging.INFO), (False, logging.DEBUG)):
        caplog.clear()
        core = ContinuumCore(PolicyConfig(log_jobs=log_jobs), FakeClock(0.0))
        with caplog.at_level(logging.DEBUG, logger="vllm_continuum.continuum"):
            core.on_arrival(forged, "r1", 0.0, named=True, prompt_tokens=10)
        (record,) = caplog.records
        assert record.levelno == level and "\n" not in record.getMessage()


def test_while_no_job_runs_only_the_pinned_jobs_growth_is_reserved():
    adm = JobAdmission(idle_timeout_s=100.0)
    adm.on_scheduled("a", 300, now=0.0)
    adm.on_stopped("a", 320, is_last_step=False, now=1.0, reserve_s=10.0)  # a: pinned
    adm.on_scheduled("b", 200, now=0.0)
    adm.on_stopped("b", 220, is_last_step=False, now=1.0, reserve_s=10.0)  # b: not held
    g = DEFAULT_TURN_GROWTH
    assert adm.reserve_tokens({"a"}, now=2.0) == g + 220 + g
    # Nothing runs: the engine would idle, so only a's growth is kept free.
    assert adm.admits(100, free_tokens=100 + g, pinned_jobs={"a"}, now=2.0)
    assert not adm.admits(101, free_tokens=100 + g, pinned_jobs={"a"}, now=2.0)
    # Once a job runs (a's next turn), the full reserve (b's context too) applies again.
    adm.on_arrival("a", 330, now=2.0)
    adm.on_scheduled("a", 330, now=2.0)
    g2 = adm.turn_growth  # 30, learned from a's turns
    assert g2 == 30 and adm.reserve_tokens(set(), now=2.0) == g2 + 220 + g2
    assert not adm.admits(100, free_tokens=100 + 2 * g2, pinned_jobs=set(), now=2.0)
    assert adm.admits(100, free_tokens=100 + 220 + 2 * g2, pinned_jobs=set(), now=2.0)
