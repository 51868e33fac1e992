"""The periodic throughput line (vLLM's LoggingStatLogger): what it counts, and that an
interval without work logs nothing."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import LoggingStatLogger
from vllm.v1.metrics.stats import OffloadStats, PrefixCacheStats, SchedulerStats

NAME = "vllm.v1.metrics.loggers"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(
    tokens: dict[str, int],
    stats: SchedulerStats | None = None,
    first: dict[str, int] | None = None,
) -> EngineCoreOutputs:
    """An engine step's outputs: ``tokens`` per request; ``first``: the prompt length of
    the requests whose first token this is (the scheduler sets it on that output only)."""
    first = first or {}
    outputs = [
        SimpleNamespace(request_id=r, new_token_ids=[7] * n, num_prompt_tokens=first.get(r))
        for r, n in tokens.items()
    ]
    return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats)


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == NAME]


def test_the_line_has_vllm_s_figures_for_the_interval(caplog):
    clock = Clock()
    stat = LoggingStatLogger(interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=NAME):
        stats = SchedulerStats(
            num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
            prefix_cache_stats=PrefixCacheStats(queries=300, hits=100),
        )  # fmt: skip
        stat.record(step({"a": 1, "b": 1}, stats, {"a": 200, "b": 100}), [])
        clock.now += 4
        # a's and b's prompts are not counted twice; c's arrives and finishes in one step.
        stat.record(step({"a": 1, "b": 1, "c": 1}, first={"c": 50}), [])
        clock.now += 6
        stat.record(step({"a": 1}), [])
        assert lines(caplog) == []  # the timer writes it
        stat.log_if_active()
    (line,) = lines(caplog)
    assert line == (
        "Engine 000: Avg prompt throughput: 35.0 tokens/s, Avg generation throughput: 0.6 "
        "tokens/s, Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache "
        "hit rate: 33.3%"
    )


def test_idle_intervals_log_nothing_and_the_next_starts_from_zero(caplog):
    clock = Clock()
    stat = LoggingStatLogger(interval_s=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=NAME):
        stat.record(step({"a": 1}, first={"a": 10}), [])
        clock.now += 5
        stat.log_if_active()
        clock.now += 5
        stat.record(step({"a": 1}), [])
        idle = SchedulerStats()  # the last step: nothing running or waiting
        stat.record(step({}, idle), [])
        clock.now += 5
        stat.log_if_active()
        for _ in range(3):  # idle: nothing to say
            clock.now += 5
            stat.log_if_active()
        tier = SchedulerStats(
            num_running_reqs=1,
            connector_prefix_cache_stats=PrefixCacheStats(queries=40, hits=30),
            offload_stats=OffloadStats(usage=0.5),
        )
        stat.record(step({"d": 4}, tier, {"d": 20}), [])
        clock.now += 4
        stat.log_if_active()
    first, second, third = lines(caplog)
    assert "Avg prompt throughput: 2.0 tokens/s" in first
    assert (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.1" in second
    )  # 1 in 10 s
    assert "Avg prompt throughput: 5.0 tokens/s, Avg generation throughput: 1.0" in third
    assert third.endswith("KV tier usage: 50.0%, KV tier hit rate: 75.0%")


def test_run_logs_on_its_timer_until_cancelled(caplog):
    stat = LoggingStatLogger(interval_s=0.01)
    stat.record(step({"a": 3}, first={"a": 5}), [])

    async def main() -> None:
        task = asyncio.create_task(stat.run())
        await asyncio.sleep(0.1)
        task.cancel()

    with caplog.at_level(logging.INFO, logger=NAME):
        asyncio.run(main())
    assert len(lines(caplog)) == 1  # once for the work, then idle


def test_disable_log_stats_is_a_server_flag():
    from vllm.entrypoints.openai.cli_args import FrontendArgs

    assert FrontendArgs().disable_log_stats is False
    assert FrontendArgs(disable_log_stats=True).disable_log_stats is True


def test_spec_decoding_line_has_the_per_position_rates(caplog):
    from vllm.v1.metrics.stats import SpecDecodingStats

    clock = Clock()
    stat = LoggingStatLogger(interval_s=10.0, clock=clock)
    first, second = SpecDecodingStats(), SpecDecodingStats()
    first.observe(3, 2)  # kept the first two of three
    first.observe(3, 0)
    second.observe(2, 1)  # a step cut to two drafts
    second.observe(3, 3)
    assert first.num_accepted_tokens_per_pos == [1, 1, 0]
    with caplog.at_level(logging.INFO, logger=NAME):
        for spec in (first, second):
            stat.record(step({"a": 1}, SchedulerStats(spec_decoding_stats=spec)), [])
        stat.log_if_active()
    spec_line = next(line for line in lines(caplog) if line.startswith("SpecDecoding"))
    # 4 steps with drafts, 11 drafted, 6 kept: [3, 2, 1] by position.
    assert spec_line == (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted: 6 tokens, Drafted: "
        "11 tokens, Draft acceptance rate: 54.5%, Per-position acceptance rate: 0.750, "
        "0.500, 0.250"
    )
