"""A policy written only against ``vllm_continuum.policy`` runs in our engine after one
registry line (tests/policies/newest_job_first.py; the same file runs on upstream vLLM's
scheduler in tests_upstream/test_new_policy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm.utils.clock import FakeClock
from vllm_continuum.policy import registry

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done, step

NAME = "newest_job_first"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[3] / "policies"))
    registry.register_policy(NAME, "newest_job_first:NewestJobFirst")
    yield
    registry.unregister_policy(NAME)


def test_a_registered_policy_orders_pins_and_frees_in_our_engine(registered):
    s = make_scheduler(policy=NAME, max_num_seqs=1, budget=64, clock=FakeClock(1.0))
    policy, clock = s.policy, s.clock
    assert type(policy).__name__ == "NewestJobFirst"
    old = make_request(list(range(1, 14)), job_id="old", arrival_time=0.0, max_tokens=2)
    new = make_request(list(range(20, 33)), job_id="new", arrival_time=1.0, max_tokens=2)
    s.add_request(old)
    s.add_request(new)
    run_until_done(s)
    scheduled = [rid for event, rid in policy.events if event == "scheduled"]
    assert scheduled == [new.request_id, old.request_id]  # the newest job went first
    assert len(s.pins) == 2  # both named, not last: pinned for PIN_S
    # The old job's next turn extends its context: its pin is the hit.
    nxt = make_request([*old.all_token_ids, 40], job_id="old", is_last_step=True, arrival_time=1.0)
    s.add_request(nxt)
    step(s)
    assert nxt.num_cached_tokens >= 12 and ("pin_hit", old.request_id) in policy.events
    run_until_done(s)
    clock.advance(1.1)  # the new job's pin outlives PIN_S
    step(s)
    assert ("pin_expired", new.request_id) in policy.events
    assert len(s.pins) == 0 and s.kv_cache_manager.usage == 0.0


def test_an_unregistered_name_is_refused(registered):
    registry.unregister_policy(NAME)
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_scheduler(policy=NAME)
