"""ab_benchmark over replicas behind a router: counters are summed over every replica's
/metrics (the router's own /metrics is one replica's), KV usage is their mean."""

from __future__ import annotations

import asyncio

from our_experiments.scripts import ab_benchmark


def test_counters_are_summed_over_replicas():
    got = ab_benchmark.summed([{"a": 1.0, "b": 2.0}, {"a": 3.0, "c": 1.0}])
    assert got == {"a": 4.0, "b": 2.0, "c": 1.0}


def test_usage_is_the_replicas_mean_and_the_queue_their_sum(monkeypatch):
    pools = {
        "http://127.0.0.1:1": {"vllm:kv_cache_usage_perc": 0.2, "vllm:num_requests_waiting": 1},
        "http://127.0.0.1:2": {"vllm:kv_cache_usage_perc": 0.6, "vllm:num_requests_waiting": 3},
    }
    monkeypatch.setattr(ab_benchmark, "scrape_metrics", lambda url: pools[url])
    sampler = ab_benchmark.UsageSampler(list(pools), period_s=0.0)

    async def one_sample():
        task = asyncio.create_task(sampler.run())
        while not sampler.usage:
            await asyncio.sleep(0)
        task.cancel()

    asyncio.run(one_sample())
    assert abs(sampler.usage[0] - 0.4) < 1e-9 and sampler.waiting[0] == 4


def test_per_replica_rows_join_the_turns_by_instance_and_the_counters_by_url():
    urls = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    pins, hits = ab_benchmark.COUNTERS["pins"], ab_benchmark.COUNTERS["pin_hits"]
    before = [{pins: 1.0}, {}]
    after = [{pins: 4.0, hits: 2.0}, {pins: 1.0}]
    rows = ab_benchmark.per_replica(urls, before, after, {"127.0.0.1:8001": 6, "other:1": 1})
    assert [(r["replica"], r["instance"], r["turns"]) for r in rows] == [
        (0, "127.0.0.1:8001", 6),
        (1, "127.0.0.1:8002", 0),
    ]
    assert (rows[0]["pins"], rows[0]["pin_hits"], rows[1]["pins"], rows[1]["pin_hits"]) == (
        3.0,
        2.0,
        1.0,
        0.0,
    )
    assert set(ab_benchmark.REPLICA_COUNTERS) <= set(rows[0])
