"""The client's prompt-caching hints in the scheduler (``vllm_continuum.cache_hints``):
``cache_ttl_s`` is a floor on a non-last turn's pin, capped by the server's max TTL;
``cache_retention: in_memory`` keeps a context out of the host-memory tier."""

from __future__ import annotations

import pytest

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.utils.clock import FakeClock
from vllm_continuum.policy.base import Offload
from vllm_continuum.policy.plain import FCFSPolicy

from ...kv_offload.helpers import FakeKV, offload_step
from ...kv_offload.helpers import run_until_done as run_with_kv
from ..conftest import make_request
from .helpers import make_scheduler, run_until_done
from .test_pinning import PinAll

PROMPT = list(range(10))  # 10 + 2 outputs = 12 tokens = 3 blocks of 4


def turn(last: bool = False, **hints):
    req = make_request(PROMPT, job_id="job", is_last_step=last, max_tokens=2)
    req.sampling_params.extra_args.update(hints)
    return req


def finish(policy=None, clock=None, **kw):
    clock = clock or FakeClock(start=0.0)
    s = make_scheduler(policy_obj=policy or FCFSPolicy(), clock=clock, **kw)
    return s, clock


def pinned_usage_at(s, clock, t: float) -> float:
    clock.advance(t - clock.now)
    s.schedule()
    return s.kv_cache_manager.usage


def test_a_ttl_floor_pins_a_turn_the_policy_would_free():
    s, clock = finish()
    s.add_request(turn(cache_ttl_s=5.0))
    run_until_done(s)
    held = s.kv_cache_manager.usage
    assert held > 0 and s.next_wakeup() == pytest.approx(clock.now + 5.0)
    assert pinned_usage_at(s, clock, clock.now + 4.9) == held
    assert pinned_usage_at(s, clock, clock.now + 0.2) == 0.0
    s.check_invariants()


def test_the_floor_is_capped_by_the_servers_max_ttl():
    s, clock = finish()  # PolicyConfig.max_ttl_s: 10 s
    s.add_request(turn(cache_ttl_s=1800.0))  # "30m"
    run_until_done(s)
    assert s.next_wakeup() == pytest.approx(clock.now + 10.0)


def test_the_floor_never_shortens_the_policys_pin_nor_pins_a_last_step():
    s, clock = finish(policy=PinAll(ttl=3.0))
    s.add_request(turn(cache_ttl_s=1.0))
    run_until_done(s)
    assert s.next_wakeup() == pytest.approx(clock.now + 3.0)
    s2, _ = finish()
    s2.add_request(turn(last=True, cache_ttl_s=5.0))
    run_until_done(s2)
    assert s2.kv_cache_manager.usage == 0.0 and s2.next_wakeup() is None


class OffloadAll(FCFSPolicy):
    def on_finished(self, request, now):
        return Offload()


@pytest.mark.parametrize("retention, saved", [(None, 2), ("24h", 2), ("in_memory", 0)])
def test_in_memory_retention_keeps_a_context_out_of_the_tier(retention, saved):
    # Both ways into the tier: the policy's Offload, and a pin that expires.
    hints = {} if retention is None else {"cache_retention": retention}
    for policy in (OffloadAll(), PinAll(ttl=1.0)):
        clock = FakeClock(start=0.0)
        s = make_scheduler(policy_obj=policy, clock=clock, num_cpu_blocks=8)
        fkv = FakeKV(s)
        s.add_request(turn(**hints))
        run_with_kv(s, fkv)
        clock.advance(1.5)  # the pin, if any, expires
        offload_step(s, fkv)
        offload_step(s, fkv)  # the saves planned by the release
        assert fkv.saved == saved, type(policy).__name__  # 3 blocks, 2 full and hashed
        s.check_invariants()


@pytest.mark.parametrize(
    "hints",
    [
        {"cache_ttl_s": 0},
        {"cache_ttl_s": -1.0},
        {"cache_ttl_s": "30m"},
        {"cache_ttl_s": True},
        {"cache_ttl_s": float("inf")},
        {"cache_retention": "forever"},
    ],
)
def test_a_hint_we_cannot_honour_is_a_validation_error(hints):
    with pytest.raises(VLLMValidationError, match="cache_"):
        SamplingParams(extra_args=hints)
