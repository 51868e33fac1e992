"""ContextServe on upstream's scheduler: FAST turns strictly pinned and hit, SLOW turns
freed at once (no CPU tier in the plugin), UNCERTAIN turns on Continuum's TTL, strict pins
last under pressure. Each step ends with the block-pool conservation check (harness.step).

Blocks of 16 tokens. A first turn of 31 prompt tokens + 2 outputs has KV for 32 tokens:
2 full (hashed) blocks, which its job's next turn finds in the prefix cache.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from conftest import make_request
from harness import (
    make_scheduler,
    random_traffic,
    run_until_done,
    step,
    upstream_parser,
    used_blocks,
)

pytest.importorskip("scipy", reason="ContextServe needs the plugin's context-serve extra")

from vllm_continuum.context_serve.config import ContextServeConfig  # noqa: E402


def bash(command: str) -> str:
    return f"```bash\n{command}\n```"


def context_serve(vllm_config, says, **kw):
    """A ContextServeScheduler whose finished turns all say ``says["text"]``."""
    return make_scheduler(
        vllm_config, text=lambda ids: says["text"], context_serve=ContextServeConfig(), **kw
    )


def test_fast_turn_is_strictly_pinned_for_its_predicted_time_and_hit(vllm_config):
    says = {"text": bash("ls -la")}  # the rule table: ls is fast
    s = context_serve(vllm_config, says)
    t1 = make_request(range(31), job="a")
    s.add_request(t1)
    run_until_done(s)
    entry = s.pins.get("a")
    assert entry.strict and entry.deadline - entry.pinned_at == 3.0  # fast_pin_s
    assert used_blocks(s) == 2
    s.clock.advance(2.5)  # past Continuum's 2 s cold-start TTL, within the FAST pin
    step(s)
    assert "a" in s.pins and used_blocks(s) == 2
    t2 = make_request([*t1.all_token_ids, 40, 41], job="a", last=True)
    s.add_request(t2)
    so, _ = step(s)
    assert so.num_scheduled_tokens[t2.request_id] == 3  # 35 tokens, 32 of them a hit
    assert len(s.pins) == 0 and s.pin_counters.hits == 1
    run_until_done(s)
    assert used_blocks(s) == 0


def test_slow_turn_is_freed_at_once(vllm_config):
    says = {"text": bash("make -j4")}  # the rule table: make is slow
    s = context_serve(vllm_config, says)
    s.add_request(make_request(range(31), job="a"))
    run_until_done(s)
    assert len(s.pins) == 0 and s.pin_counters.pins == 0 and used_blocks(s) == 0


def test_uncertain_turn_gets_continuums_ttl(vllm_config):
    says = {"text": bash("python x.py")}  # no rule, no data: UNCERTAIN
    s = context_serve(vllm_config, says)
    released = []
    s.on_pin_released = lambda entry, now, why: released.append(why)
    s.add_request(make_request(range(31), job="a"))
    run_until_done(s)
    entry = s.pins.get("a")
    assert not entry.strict and entry.deadline - entry.pinned_at == 2.0  # default_ttl_s
    s.clock.advance(2.1)
    step(s)
    assert released == ["expired"] and used_blocks(s) == 0


def test_the_measured_tool_time_teaches_the_predictor(vllm_config):
    says = {"text": bash("python x.py")}
    s = context_serve(vllm_config, says)
    t1 = make_request(range(31), job="a")
    s.add_request(t1)
    run_until_done(s)
    s.clock.advance(0.7)
    s.add_request(make_request([*t1.all_token_ids, 1], job="a", last=True))
    run_until_done(s)
    posteriors = s.core.predictor.bayes.posteriors.values()
    assert sum(p.n for p in posteriors) == 1  # 0.7 s, measured at the next arrival


def test_pressure_releases_a_soft_pin_before_a_newer_strict_one(vllm_config):
    # 8 usable blocks: "soft" (older job, UNCERTAIN) and "strict" (newer job, FAST) pin 2
    # blocks each. A request growing to 70 tokens (5 blocks) needs one of them: the soft
    # pin goes although its job is the older one.
    says = {"text": bash("python x.py")}
    s = context_serve(vllm_config, says, num_blocks=9)
    released = []
    s.on_pin_released = lambda entry, now, why: released.append((entry.job, why))
    s.add_request(make_request(range(31), job="soft"))
    run_until_done(s)
    s.clock.advance(0.1)
    says["text"] = bash("ls")
    s.add_request(make_request(range(50, 81), job="strict"))
    run_until_done(s)
    assert not s.pins.get("soft").strict and s.pins.get("strict").strict
    big = make_request(range(100, 140), max_tokens=30)
    s.add_request(big)
    run_until_done(s)
    assert released == [("soft", "pressure")] and "strict" in s.pins
    assert big.num_preemptions == 0


def test_random_traffic_with_admission_never_leaks(vllm_config):
    """Random jobs whose turns call fast, slow and unknown tools, with job admission on;
    the pool check runs after every step, and at shutdown every block is back."""
    commands = ["ls", "make", "python x.py", "cat f", "pip install x", ""]
    pick = random.Random(2)
    s = make_scheduler(
        vllm_config, text=lambda ids: bash(pick.choice(commands)),
        context_serve=ContextServeConfig(), num_blocks=17, max_num_seqs=4, job_admission=True,
    )  # fmt: skip
    random_traffic(s, random.Random(1), 250, drain_tick=0.5)
    assert s.pin_counters.pins > 0 and s.pin_counters.hits > 0
    s.shutdown()
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1


def test_context_serve_is_a_scheduling_policy_with_its_own_settings():
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm_continuum.upstream import cli
    from vllm_continuum.upstream.scheduler import PolicyScheduler, policy_name_from
    from vllm_continuum.upstream.settings import context_serve_config_from

    settings = '{"continuum": {"max_ttl_s": 5}, "context_serve": {"fast_pin_s": 1.5}}'
    args = upstream_parser().parse_args(
        ["--scheduling-policy", "context_serve", "--additional-config", settings]
    )
    engine_args = AsyncEngineArgs.from_cli_args(args)
    cli.apply_policy(engine_args)
    assert engine_args.scheduler_cls == cli.SCHEDULER
    assert policy_name_from(engine_args.additional_config) == "context_serve"
    config = SchedulerConfig(
        scheduler_cls=engine_args.scheduler_cls, max_model_len=512, is_encoder_decoder=False
    )
    assert config.get_scheduler_cls() is PolicyScheduler
    cs_config = context_serve_config_from(engine_args.additional_config)
    assert cs_config.fast_pin_s == 1.5 and cs_config.offload_slow  # acts only with a tier
    with pytest.raises(ValueError, match="fast_pin_s"):
        context_serve_config_from({"context_serve": {"fast_pin_s": -1}})
    with pytest.raises(ValueError, match="unknown keys"):
        context_serve_config_from({"context_serve": {"offload_slower": True}})


def _series(vllm_config):
    """A sample reader of the default registry, for this engine's labels."""
    from prometheus_client import REGISTRY

    engine = {"model_name": vllm_config.model_config.served_model_name, "engine": "0"}
    return lambda name, **labels: REGISTRY.get_sample_value(name, {**engine, **labels}) or 0.0


def test_context_serve_series_reach_prometheus_once_each(vllm_config):
    """ContextServe's own series (our engine's ``vllm:context_serve_*``) through upstream's
    stats channel: the verdict and the FAST pin's hit, each counted once though every
    report carries the totals."""
    from vllm_continuum.upstream.metrics import POLICY_PREFIX, PinStatLogger

    says = {"text": bash("ls -la")}  # the rule table: ls is fast
    s = context_serve(vllm_config, says)
    t1 = make_request(range(31), job="a")
    s.add_request(t1)
    run_until_done(s)
    s.clock.advance(1.0)
    s.add_request(make_request([*t1.all_token_ids, 40, 41], job="a", last=True))
    run_until_done(s)
    logger, value = PinStatLogger(vllm_config, 0), _series(vllm_config)
    names = [("vllm:context_serve_decisions_total", {"speed": "fast", "layer": "rules"}),
             ("vllm:context_serve_fast_pins_total", {"outcome": "hit"})]  # fmt: skip
    before = [value(name, **labels) for name, labels in names]
    for _ in range(3):
        stats = s.make_stats()
        logger.record(stats, None, engine_idx=0)
        assert not any(k.startswith(POLICY_PREFIX) for k in stats.num_kv_fetch_reqs_by_stage)
    after = [value(name, **labels) for name, labels in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]


def test_a_histogram_observation_is_observed_once_of_the_reports_that_carry_it(vllm_config):
    from vllm_continuum.context_serve.stats import CONTEXT_SERVE_METRICS, ContextServeStats
    from vllm_continuum.upstream.metrics import OBSERVATION_REPORTS, PinStatLogger, PolicyStatTotals

    totals, logger = PolicyStatTotals(CONTEXT_SERVE_METRICS), PinStatLogger(vllm_config, 0)
    value = _series(vllm_config)
    name = "vllm:context_serve_prediction_error_seconds"
    count, total = value(name + "_count"), value(name + "_sum")
    totals.add(ContextServeStats(prediction_errors_s=[0.25, 1.5]))
    carried = 0
    for _ in range(OBSERVATION_REPORTS + 2):
        by_stage: dict[str, int] = {}
        totals.write(by_stage)
        carried += len(by_stage)
        logger.record(SimpleNamespace(num_kv_fetch_reqs_by_stage=by_stage), None)
    assert carried == 2 * OBSERVATION_REPORTS and not totals.observations
    assert value(name + "_count") - count == 2 and value(name + "_sum") - total == 1.75
    assert value(name + "_bucket", le="0.25") >= 1
