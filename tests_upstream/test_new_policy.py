"""A policy written only against ``vllm_continuum.policy`` runs on upstream vLLM's
scheduler after one registry line: tests/policies/newest_job_first.py, the same file
tests/v1/core/sched/test_new_policy.py runs in our engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_request
from harness import make_scheduler, run_until_done, step, used_blocks

from vllm_continuum.policy import registry

NAME = "newest_job_first"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "tests" / "policies"))
    registry.register_policy(NAME, "newest_job_first:NewestJobFirst")
    yield
    registry.unregister_policy(NAME)


def test_a_registered_policy_orders_pins_and_frees_on_upstream(registered, vllm_config):
    from vllm_continuum.upstream import cli
    from vllm_continuum.upstream.scheduler import PolicyScheduler

    assert NAME in cli.our_policies()  # offered to --scheduling-policy with no other change
    s = make_scheduler(
        vllm_config, max_num_seqs=1,
        cls=lambda **kw: PolicyScheduler(policy_name=NAME, **kw),
    )  # fmt: skip
    policy, clock = s.agent_policy, s.clock
    assert type(policy).__name__ == "NewestJobFirst"
    old = make_request(range(1, 32), job="old")
    s.add_request(old)
    clock.advance(1.0)
    new = make_request(range(40, 71), job="new")
    s.add_request(new)
    run_until_done(s)
    scheduled = [rid for event, rid in policy.events if event == "scheduled"]
    assert scheduled == [new.request_id, old.request_id]  # the newest job went first
    assert len(s.pins) == 2 and used_blocks(s) == 4  # both named, not last: pinned
    nxt = make_request([*old.all_token_ids, 80], job="old", last=True)
    s.add_request(nxt)
    so, _ = step(s)
    assert so.num_scheduled_tokens[nxt.request_id] == 2  # 34 tokens, 32 of them a hit
    assert ("pin_hit", old.request_id) in policy.events
    run_until_done(s)
    clock.advance(1.1)  # the new job's pin outlives PIN_S
    step(s)
    assert ("pin_expired", new.request_id) in policy.events
    assert len(s.pins) == 0 and used_blocks(s) == 0
