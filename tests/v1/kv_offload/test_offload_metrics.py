"""The tier's metrics: vLLM's external prefix cache counters, usage, copies, bytes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.prometheus import PrometheusStatLogger

from ..core.conftest import make_request
from .helpers import FakeKV, make_offload_scheduler, offload_step
from .test_offload_scheduler import A, B


def test_scheduler_stats_and_prometheus_report_the_tier():
    s = make_offload_scheduler(num_blocks=6, num_cpu_blocks=8)
    s.kv_cache_manager.offload.block_bytes = 100
    fkv = FakeKV(s)
    logger = PrometheusStatLogger("smol", registry=CollectorRegistry())
    totals = {"saved": 0, "loaded": 0, "bytes": 0, "queries": 0, "hits": 0}
    # A evicted by B (3 saves); A loaded back (3 loads) into blocks evicted from B (3 saves).
    for prompt in (A, B, A):
        s.add_request(make_request(prompt, max_tokens=1))
        while s.has_unfinished_requests():
            _, out = offload_step(s, fkv)
            st = out.scheduler_stats
            totals["saved"] += st.offload_stats.blocks_saved
            totals["loaded"] += st.offload_stats.blocks_loaded
            totals["bytes"] += st.offload_stats.bytes_moved
            totals["queries"] += st.connector_prefix_cache_stats.queries
            totals["hits"] += st.connector_prefix_cache_stats.hits
            logger.record(out, [])
    assert totals == {"saved": 6, "loaded": 3, "bytes": 9 * 100, "queries": 43, "hits": 12}
    assert st.offload_stats.usage == 6 / 8

    def value(name):
        return logger.registry.get_sample_value(name, {"model_name": "smol", "engine": "0"})

    assert value("vllm:external_prefix_cache_queries_total") == 43
    assert value("vllm:external_prefix_cache_hits_total") == 12
    assert value("vllm:kv_offload_blocks_saved_total") == 6
    assert value("vllm:kv_offload_blocks_loaded_total") == 3
    assert value("vllm:kv_offload_bytes_total") == 900
    assert value("vllm:kv_offload_usage_perc") == 6 / 8


def test_no_tier_no_tier_stats():
    s = make_offload_scheduler(num_cpu_blocks=0)
    s.add_request(make_request(A, max_tokens=1))
    stats = s.make_stats()
    assert stats.offload_stats is None and stats.connector_prefix_cache_stats is None
    PrometheusStatLogger("smol", registry=CollectorRegistry()).record(
        EngineCoreOutputs(outputs=[], scheduler_stats=stats), []
    )
