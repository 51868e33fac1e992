"""KV cache residency metrics (--kv-cache-metrics): the collector, the pool's hooks, the
scheduler's stats, the wire and the Prometheus histograms."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.v1.core.conftest import make_request
from tests.v1.core.sched.helpers import BLOCK, step
from vllm.config import CacheConfig, ObservabilityConfig, SchedulerConfig, VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.clock import FakeClock
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
from vllm.v1.core.sched.policy import create_policy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import (
    EngineCoreOutputs,
    EngineCoreOutputType,
    StampedOutputs,
    decode_message,
    encode_message,
)
from vllm.v1.metrics.prometheus import PrometheusStatLogger
from vllm.v1.metrics.stats import KVCacheEvictionEvent, SchedulerStats
from vllm_continuum.policy.base import FREE, Pin
from vllm_continuum.policy.plain import FCFSPolicy

RESIDENCY = (
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:kv_block_reuse_gap_seconds",
)


def event(lifetime: float, idle: float, *gaps: float) -> KVCacheEvictionEvent:
    return KVCacheEvictionEvent(lifetime, idle, tuple(gaps))


# -- the collector ------------------------------------------------------------------------
def test_collector_times_one_block_exactly():
    clock = FakeClock()
    collector = KVCacheMetricsCollector(1.0, clock)
    pool = BlockPool(4)
    block = pool.blocks[1]
    collector.on_block_allocated(block)  # t=1000: birth
    for dt in (2, 3, 0.5, 4, 1):  # hits at 1002, 1005, 1005.5, 1009.5, 1010.5
        clock.advance(dt)
        collector.on_block_accessed(block)
    clock.advance(6)  # evicted at 1016.5
    collector.on_block_evicted(block)
    # Lifetime from birth, idle from the last hit; the gaps of the last 4 hits only.
    assert collector.drain_events() == [event(16.5, 6, 0.5, 4, 1)]
    assert collector.drain_events() == [] and not collector.block_metrics


def test_collector_block_never_hit_is_idle_its_whole_life():
    clock = FakeClock()
    collector = KVCacheMetricsCollector(1.0, clock)
    block = BlockPool(4).blocks[2]
    collector.on_block_allocated(block)
    clock.advance(7)
    collector.on_block_evicted(block)
    collector.on_block_evicted(block)  # no longer tracked: nothing more
    assert collector.drain_events() == [event(7, 7)]


def test_collector_reset_clears_blocks_and_pending_events():
    collector = KVCacheMetricsCollector(1.0, FakeClock())
    blocks = BlockPool(4).blocks
    for b in blocks[1:]:
        collector.on_block_allocated(b)
    collector.on_block_evicted(blocks[1])
    collector.reset()
    assert not collector.block_metrics and collector.drain_events() == []
    collector.on_block_evicted(blocks[2])  # forgotten by the reset
    assert collector.drain_events() == []


def test_sampling_is_seeded_and_near_its_rate():
    blocks = BlockPool(2001).blocks[1:]

    def tracked(seed: int) -> set[int]:
        collector = KVCacheMetricsCollector(0.25, FakeClock(), seed)
        for b in blocks:
            collector.on_block_allocated(b)
        return set(collector.block_metrics)

    assert tracked(3) == tracked(3) != tracked(4)
    assert 400 < len(tracked(3)) < 600  # 2000 blocks at 0.25


@pytest.mark.parametrize("rate", [0, -0.1, 1.5, True])
def test_collector_refuses_a_bad_rate(rate):
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        KVCacheMetricsCollector(rate, FakeClock())


# -- the block pool's hooks ---------------------------------------------------------------
def test_pool_reports_allocation_hit_and_eviction():
    clock = FakeClock()
    collector = KVCacheMetricsCollector(1.0, clock)
    pool = BlockPool(3, metrics_collector=collector)  # 2 usable blocks
    a, b = pool.get_new_blocks(2)  # t=1000
    a.block_hash = b"h"  # as cache_full_blocks would
    pool.cached_block_hash_to_block.insert(b"h", a)
    pool.num_cached_blocks += 1
    pool.free_blocks([b, a])  # queue: b, a
    clock.advance(2)
    pool.touch([a])  # a prefix hit at 1002 takes a out of the queue
    pool.free_blocks([a])  # queue: b, a
    clock.advance(3)
    pool.get_new_blocks(2)  # both reused at 1005: a (cached, hit once) is evicted; b held
    assert collector.drain_events() == [event(5, 3)]  # no hash, so no eviction (as vLLM)
    assert set(collector.block_metrics) == {a.block_id, b.block_id}  # their new lives
    pool.check_invariants()


def test_pool_without_prefix_caching_evicts_nothing():
    collector = KVCacheMetricsCollector(1.0, FakeClock())
    pool = BlockPool(3, enable_caching=False, metrics_collector=collector)
    pool.free_blocks(pool.get_new_blocks(2))
    pool.get_new_blocks(2)  # as vLLM: nothing was cached, so no eviction is recorded
    assert collector.drain_events() == [] and len(collector.block_metrics) == 2


# -- the scheduler ------------------------------------------------------------------------
def make_scheduler(
    clock: FakeClock, num_blocks: int = 5, policy=None, **observability
) -> Scheduler:
    config = VllmConfig(
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=64, max_model_len=64),
        observability_config=ObservabilityConfig(**observability),
    )
    if policy is None:
        policy = create_policy(config, decode=lambda ids: "", clock=clock, has_kv_tier=False)
    return Scheduler(config, num_blocks, policy=policy, clock=clock)


def run(sched: Scheduler, prompt: list[int], **kw) -> list[KVCacheEvictionEvent]:
    """Serve one request to its end; the eviction events its steps' stats carried."""
    sched.add_request(make_request(prompt, block_size=BLOCK, max_tokens=1, **kw))
    events = []
    while sched.has_unfinished_requests():
        _, out = step(sched)  # check_invariants after every step
        events += out.scheduler_stats.kv_cache_eviction_events
    return events


def test_scheduler_prefix_hits_and_evictions_give_exact_times():
    clock = FakeClock()
    sched = make_scheduler(clock, kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    prefix = list(range(1, 9))  # 2 full blocks
    # 4 usable blocks (1-4), free queue [1, 2, 3, 4]; each request computes its prompt in
    # one step, samples 1 token and finishes; its blocks join the queue's tail, tail first.
    assert run(sched, prefix) == []  # t=1000: A takes 1, 2 (hashed); queue [3, 4, 2, 1]
    clock.advance(5)
    assert run(sched, prefix + [20, 21, 22, 23]) == []  # t=1005: B hits 1, 2, takes 3
    clock.advance(3)  # queue [4, 3, 2, 1]
    assert run(sched, prefix + [30, 31, 32, 33]) == []  # t=1008: C hits 1, 2, takes 4
    clock.advance(10)  # queue [3, 4, 2, 1]
    events = run(sched, list(range(100, 112)))  # t=1018: D's 3 blocks evict 3, 4, 2
    assert events == [
        event(13, 13),  # 3: B's at 1005, never hit
        event(10, 10),  # 4: C's at 1008, never hit
        event(18, 10, 3),  # 2: A's at 1000, hit at 1005 and 1008
    ]
    assert sched.make_stats().kv_cache_eviction_events == []  # drained by the steps
    tracked = sched.kv_metrics_collector.block_metrics
    assert set(tracked) == {1, 2, 3, 4}  # D's new blocks and A's block 1
    assert sched.reset_prefix_cache()
    assert not tracked and sched.make_stats().kv_cache_eviction_events == []


class PinTurns(FCFSPolicy):
    """Pins every non-last turn of a job for 100 s (as Continuum pins for a tool call)."""

    def on_finished(self, request, now):
        return Pin(100.0) if request.job_id and not request.is_last_step else FREE


def test_pinned_blocks_outlive_the_pressure_and_record_the_next_turns_hit():
    clock = FakeClock()
    sched = make_scheduler(clock, policy=PinTurns(), kv_cache_metrics=True)
    assert sched.kv_metrics_collector.sample_rate == 0.01  # vLLM's default...
    sched.kv_metrics_collector.sample_rate = 1.0  # ...every block here
    turn = list(range(1, 9))
    # t=1000: the job's first turn takes blocks 1, 2 and pins them; 3, 4 stay free.
    assert run(sched, turn, job_id="job") == []
    clock.advance(4)  # a tool call; meanwhile other requests take the free blocks twice
    assert run(sched, list(range(40, 48))) == []  # t=1004: takes 3, 4 (new)
    clock.advance(1)
    # t=1005: evicts 3, 4 (the pinned blocks cannot be taken)
    assert run(sched, list(range(50, 58))) == [event(1, 1), event(1, 1)]
    clock.advance(2)
    # t=1007: the job's last turn hits its pinned blocks (an access at 1007 each) and
    # takes one more block, evicting one of the 1005 request's
    last = turn + [60, 61, 62, 63]
    assert run(sched, last, job_id="job", is_last_step=True) == [event(2, 2)]
    tracked = sched.kv_metrics_collector.block_metrics
    assert [list(tracked[b].access_history) for b in (1, 2)] == [[1007.0], [1007.0]]


def test_flag_off_means_no_collector():
    sched = make_scheduler(FakeClock())
    assert sched.kv_metrics_collector is None
    assert sched.kv_cache_manager.block_pool.metrics_collector is None
    assert run(sched, list(range(1, 13))) == run(sched, list(range(20, 32))) == []


def test_events_cross_the_wire():
    stats = SchedulerStats(kv_cache_eviction_events=[event(18, 10, 3), event(1, 1)])
    payload = StampedOutputs(EngineCoreOutputs(scheduler_stats=stats), 0.0, {})
    frames = encode_message(EngineCoreOutputType.OUTPUTS, payload)
    _, back = decode_message(EngineCoreOutputType, frames)
    assert back.outputs.scheduler_stats.kv_cache_eviction_events == [
        event(18, 10, 3),
        event(1, 1),
    ]


# -- config and flags ---------------------------------------------------------------------
def test_config_defaults_are_vllms():
    config = ObservabilityConfig()
    assert config.kv_cache_metrics is False and config.kv_cache_metrics_sample == 0.01


@pytest.mark.parametrize("rate", [0, 1.5, -1, float("nan"), "half"])
def test_config_refuses_a_sample_rate_outside_0_1(rate):
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        ObservabilityConfig(kv_cache_metrics_sample=rate)


def _engine_config(argv: list[str]) -> VllmConfig:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(exit_on_error=False))
    return EngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()


def test_flags_reach_the_config():
    config = _engine_config(["--kv-cache-metrics", "--kv-cache-metrics-sample", "0.5"])
    assert config.observability_config == ObservabilityConfig(True, 0.5)
    assert _engine_config([]).observability_config == ObservabilityConfig()
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        _engine_config(["--kv-cache-metrics-sample", "0"])


# -- Prometheus ---------------------------------------------------------------------------
def _record(logger: PrometheusStatLogger, events: list[KVCacheEvictionEvent]) -> None:
    logger.record(
        EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_cache_eviction_events=events)), []
    )


def test_histograms_only_with_the_flag():
    off = PrometheusStatLogger("smol", registry=CollectorRegistry())
    _record(off, [event(18, 10, 3)])  # ignored without the flag
    text = generate_latest(off.registry).decode()
    assert not any(name in text for name in RESIDENCY)

    on = PrometheusStatLogger("smol", registry=CollectorRegistry(), kv_cache_metrics=True)
    text = generate_latest(on.registry).decode()
    assert all(f"{name}_bucket" in text for name in RESIDENCY)  # from the start, at 0
    _record(on, [event(18, 10, 3, 0.004), event(1, 1)])

    def sample(name: str, suffix: str, **labels) -> float | None:
        return on.registry.get_sample_value(
            name + suffix, {"model_name": "smol", "engine": "0", **labels}
        )

    lifetime, idle, gap = RESIDENCY
    assert sample(lifetime, "_count") == 2 and sample(lifetime, "_sum") == 19
    assert sample(idle, "_count") == 2 and sample(idle, "_sum") == 11
    assert sample(gap, "_count") == 2 and sample(gap, "_sum") == pytest.approx(3.004)
    assert sample(gap, "_bucket", le="0.005") == 1  # vLLM's millisecond buckets
    assert sample(lifetime, "_bucket", le="1800.0") == 2
