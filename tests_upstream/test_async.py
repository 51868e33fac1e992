"""The async-scheduling variants over upstream's ``AsyncScheduler``, driven in its order:
step N+1 is scheduled before step N's output is processed (harness.Pipeline), with the
block-pool conservation check after every update.

A first turn of 31 prompt tokens + 2 outputs: upstream schedules no step past
``max_tokens``, so its KV covers 32 tokens in 2 full blocks, as without async scheduling.
"""

from __future__ import annotations

import random

from conftest import make_request
from harness import Pipeline, make_scheduler, random_traffic, used_blocks

from vllm_continuum.upstream import cli
from vllm_continuum.upstream.scheduler import (
    AsyncContinuumScheduler,
    AsyncPolicyScheduler,
    ContinuumScheduler,
    PolicyScheduler,
)


def test_the_cli_picks_the_async_variant_when_upstream_turns_async_on():
    from vllm.config import SchedulerConfig

    def resolved(cls_path, async_scheduling):
        config = SchedulerConfig(
            scheduler_cls=cls_path,
            async_scheduling=async_scheduling,
            max_model_len=512,
            is_encoder_decoder=False,
        )
        cli.use_async_variant(config)
        return config.get_scheduler_cls()

    assert resolved(cli.SCHEDULER, True) is AsyncPolicyScheduler
    assert resolved(cli.SCHEDULER, False) is PolicyScheduler
    continuum = "vllm_continuum.upstream.scheduler.ContinuumScheduler"
    assert resolved(continuum, True) is AsyncContinuumScheduler  # a --scheduler-cls given
    assert resolved(continuum, False) is ContinuumScheduler


def test_pin_held_and_hit_with_a_step_in_flight(vllm_config):
    s = make_scheduler(vllm_config, cls=AsyncContinuumScheduler)
    pipeline = Pipeline(s)
    t1 = make_request(range(31), job="a")
    s.add_request(t1)
    pipeline.run_until_done()
    assert len(s.pins) == 1 and used_blocks(s) == 2
    s.clock.advance(1.0)
    t2 = make_request([*t1.all_token_ids, 40, 41], job="a", last=True)
    s.add_request(t2)
    so = pipeline.step()
    assert so.num_scheduled_tokens[t2.request_id] == 3  # 35 tokens, 32 of them a hit
    assert len(s.pins) == 0 and s.pin_counters.hits == 1
    pipeline.run_until_done()
    assert used_blocks(s) == 0


def test_random_traffic_with_a_step_in_flight_never_leaks(vllm_config):
    s = make_scheduler(
        vllm_config, cls=AsyncContinuumScheduler, num_blocks=17, max_num_seqs=4,
        job_admission=True,
    )  # fmt: skip
    random_traffic(s, random.Random(3), 250, pipeline=Pipeline(s), drain_tick=0.5)
    assert s.pin_counters.pins > 0 and s.pin_counters.hits > 0
    s.shutdown()
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1
