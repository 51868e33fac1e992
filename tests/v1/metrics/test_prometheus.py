"""PrometheusStatLogger: engine stats and finished requests -> vLLM-named metrics.

Each test gets its own CollectorRegistry, so the loggers never collide; values are read
with ``registry.get_sample_value`` and the exposition text with ``generate_latest``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.metrics.prometheus import PrometheusStatLogger
from vllm.v1.metrics.stats import PinStats, PrefixCacheStats, SchedulerStats
from vllm_continuum.metrics import MetricSpec, by_label, each_of, value_of
from vllm_continuum.policy.plain import FCFSPolicy

MODEL = "smol"
LABEL = {"model_name": MODEL, "engine": "0"}


@pytest.fixture
def stats():
    return PrometheusStatLogger(MODEL, registry=CollectorRegistry())


def value(stats: PrometheusStatLogger, name: str, **labels) -> float | None:
    return stats.registry.get_sample_value(name, {**LABEL, **labels})


def sched_stats(**kw) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=kw.get("running", 0),
        num_waiting_reqs=kw.get("waiting", 0),
        kv_cache_usage=kw.get("usage", 0.0),
        num_preemptions=kw.get("preemptions", 0),
        prefix_cache_stats=PrefixCacheStats(
            requests=1, queries=kw.get("queries", 0), hits=kw.get("hits", 0)
        ),
        pin_stats=PinStats(
            num_pinned_requests=kw.get("pinned_reqs", 0),
            pinned_kv_blocks=kw.get("pinned_blocks", 0),
            pins=kw.get("pins", 0),
            pin_hits=kw.get("pin_hits", 0),
            expiries=kw.get("expiries", 0),
            forced_releases=kw.get("forced", 0),
        ),
    )


def core(s: SchedulerStats | None = None, tokens: dict[str, int] | None = None):
    outs = [EngineCoreOutput(r, list(range(n))) for r, n in (tokens or {}).items()]
    return EngineCoreOutputs(outputs=outs, scheduler_stats=s)


def finished(
    req_id: str,
    num_prompt: int,
    reason: str | None,
    metrics: RequestMetrics | None = None,
    finished_flag: bool = True,
) -> RequestOutput:
    comp = CompletionOutput(0, "x", [1], finish_reason=reason)
    return RequestOutput(req_id, None, list(range(num_prompt)), [comp], finished_flag, 0, metrics)


def test_gauges_take_the_latest_step_values(stats):
    stats.record(core(sched_stats(running=3, waiting=5, usage=0.25, pinned_reqs=2)), [])
    stats.record(
        core(sched_stats(running=1, waiting=0, usage=0.5, pinned_reqs=1, pinned_blocks=6)), []
    )
    assert value(stats, "vllm:num_requests_running") == 1.0
    assert value(stats, "vllm:num_requests_waiting") == 0.0
    assert value(stats, "vllm:kv_cache_usage_perc") == 0.5
    assert value(stats, "vllm:num_pinned_requests") == 1.0
    assert value(stats, "vllm:pinned_kv_blocks") == 6.0


STATE_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_pinned_requests",
    "vllm:pinned_kv_blocks",
)


def test_a_dead_engine_zeroes_the_state_gauges_and_says_so(stats):
    # --keep-alive-on-engine-death: /metrics must not show the last step as if live.
    busy = sched_stats(running=3, waiting=5, usage=0.25, pinned_reqs=2, pinned_blocks=8)
    stats.record(core(busy, tokens={"a": 1}), [])
    assert value(stats, "vllm:engine_alive") == 1.0
    assert all(value(stats, name) > 0 for name in STATE_GAUGES)
    stats.mark_engine_dead()
    assert value(stats, "vllm:engine_alive") == 0.0
    assert all(value(stats, name) == 0.0 for name in STATE_GAUGES)
    # A message the engine sent before dying, handled after: its events count, its
    # gauges do not come back.
    stats.record(core(sched_stats(running=3, queries=10), tokens={"a": 2}), [])
    assert all(value(stats, name) == 0.0 for name in STATE_GAUGES)
    assert value(stats, "vllm:generation_tokens_total") == 3.0
    assert value(stats, "vllm:prefix_cache_queries_total") == 10.0
    stats.mark_engine_dead()  # idempotent (every scrape of a dead engine calls it)
    assert value(stats, "vllm:engine_alive") == 0.0


def test_counters_accumulate_the_deltas(stats):
    stats.record(
        core(sched_stats(queries=100, hits=40, preemptions=1, pins=2, pin_hits=1, expiries=0)), []
    )
    stats.record(
        core(sched_stats(queries=50, hits=50, preemptions=2, pins=1, expiries=1, forced=3)), []
    )
    assert value(stats, "vllm:prefix_cache_queries_total") == 150.0
    assert value(stats, "vllm:prefix_cache_hits_total") == 90.0
    assert value(stats, "vllm:num_preemptions_total") == 3.0
    assert value(stats, "vllm:pins_total") == 3.0
    assert value(stats, "vllm:pin_hits_total") == 1.0
    assert value(stats, "vllm:pin_expiries_total") == 1.0
    assert value(stats, "vllm:pin_forced_releases_total") == 3.0


def test_step_without_scheduler_stats_keeps_gauges_and_counts_tokens(stats):
    stats.record(core(sched_stats(running=2, queries=10)), [])
    stats.record(core(None, tokens={"a": 1, "b": 3}), [])
    stats.record(core(None, tokens={"a": 2}), [])
    assert value(stats, "vllm:num_requests_running") == 2.0
    assert value(stats, "vllm:prefix_cache_queries_total") == 10.0
    assert value(stats, "vllm:generation_tokens_total") == 6.0


def test_finished_requests_count_prompt_tokens_and_success_by_reason(stats):
    stats.record(
        core(),
        [
            finished("a", 7, "stop"),
            finished("b", 3, "length"),
            finished("c", 5, "stop"),
            finished("d", 100, None, finished_flag=False),  # still running: not counted
        ],
    )
    assert value(stats, "vllm:prompt_tokens_total") == 15.0
    assert value(stats, "vllm:request_success_total", finished_reason="stop") == 2.0
    assert value(stats, "vllm:request_success_total", finished_reason="length") == 1.0


def test_finished_without_a_reason_counts_as_abort(stats):
    out = finished("a", 2, None)
    empty = RequestOutput("b", None, [1], [], True)
    stats.record(core(), [out, empty])
    assert value(stats, "vllm:request_success_total", finished_reason="abort") == 2.0


def timed_request(**more) -> RequestMetrics:
    """Arrival 100, first token 100.3, last 101.3 after 5 tokens (TPOT 1.0 / 4 = 0.25),
    finished 101.5 (e2e 1.5), queued 0.02 s (scheduled at 100.02)."""
    times = dict(first_token_time=100.3, last_token_time=101.3, finished_time=101.5)
    return RequestMetrics(100.0, **times, queue_time=0.02, num_generation_tokens=5, **more)


def test_latency_histograms_from_request_metrics(stats):
    m = timed_request()
    stats.record(core(), [finished("a", 4, "stop", m)])
    ttft = "vllm:time_to_first_token_seconds"
    assert value(stats, ttft + "_count") == 1.0
    assert value(stats, ttft + "_sum") == pytest.approx(0.3)
    assert value(stats, ttft + "_bucket", le="0.25") == 0.0
    assert value(stats, ttft + "_bucket", le="0.5") == 1.0
    tpot = "vllm:time_per_output_token_seconds"
    assert value(stats, tpot + "_sum") == pytest.approx(0.25)
    assert value(stats, tpot + "_bucket", le="0.2") == 0.0
    assert value(stats, tpot + "_bucket", le="0.3") == 1.0
    assert value(stats, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.5)
    assert value(stats, "vllm:e2e_request_latency_seconds_bucket", le="1.0") == 0.0
    assert value(stats, "vllm:e2e_request_latency_seconds_bucket", le="2.5") == 1.0
    assert value(stats, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.02)
    assert value(stats, "vllm:request_queue_time_seconds_bucket", le="0.025") == 1.0


def test_vllm_s_request_phase_and_size_histograms(stats):
    # The 5 tokens over n=2 sequences (the longer has 3), max_tokens 64, 3 of 4 prompt
    # tokens cached.
    m = timed_request(max_num_generation_tokens=3, n=2, max_tokens=64)
    out = finished("a", 4, "stop", m)
    out.num_cached_tokens = 3
    stats.record(core(), [out])
    assert value(stats, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.28)
    assert value(stats, "vllm:request_decode_time_seconds_sum") == pytest.approx(1.0)
    assert value(stats, "vllm:request_inference_time_seconds_sum") == pytest.approx(1.28)
    assert value(stats, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.25)
    assert value(stats, "vllm:request_prompt_tokens_sum") == 4.0
    assert value(stats, "vllm:request_prompt_tokens_bucket", le="5.0") == 1.0
    assert value(stats, "vllm:request_prompt_tokens_bucket", le="2.0") == 0.0
    assert value(stats, "vllm:request_generation_tokens_sum") == 5.0
    assert value(stats, "vllm:request_max_num_generation_tokens_sum") == 3.0
    assert value(stats, "vllm:request_params_n_bucket", le="2.0") == 1.0
    assert value(stats, "vllm:request_params_n_bucket", le="1.0") == 0.0
    assert value(stats, "vllm:request_params_max_tokens_sum") == 64.0
    assert value(stats, "vllm:prompt_tokens_cached_total") == 3.0


def test_inter_token_latencies_and_step_sizes(stats):
    busy = sched_stats(running=1)
    busy.num_scheduled_tokens = 300
    stats.record(core(busy, tokens={"a": 1}), [], [0.02, 0.2])
    stats.record(core(sched_stats()), [])  # a report without a step: no step size
    assert value(stats, "vllm:inter_token_latency_seconds_count") == 2.0
    assert value(stats, "vllm:inter_token_latency_seconds_bucket", le="0.025") == 1.0
    assert value(stats, "vllm:iteration_tokens_total_count") == 1.0
    assert value(stats, "vllm:iteration_tokens_total_bucket", le="256.0") == 0.0
    assert value(stats, "vllm:iteration_tokens_total_bucket", le="512.0") == 1.0


def test_token_buckets_follow_the_models_limits():
    big = PrometheusStatLogger(
        MODEL, CollectorRegistry(), max_model_len=131072, max_num_batched_tokens=8192
    )
    text = generate_latest(big.registry).decode()
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="100000.0"' in text
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="200000.0"' not in text
    assert 'vllm:iteration_tokens_total_bucket{engine="0",le="8192.0"' in text


def test_single_token_request_has_no_tpot_and_missing_times_are_skipped(stats):
    one = RequestMetrics(100.0, first_token_time=100.1, last_token_time=100.1,
                         finished_time=100.2, num_generation_tokens=1)  # fmt: skip
    never = RequestMetrics(100.0)  # aborted before its first token
    stats.record(core(), [finished("a", 1, "stop", one), finished("b", 1, "abort", never)])
    assert value(stats, "vllm:time_to_first_token_seconds_count") == 1.0
    assert value(stats, "vllm:time_per_output_token_seconds_count") == 0.0
    assert value(stats, "vllm:e2e_request_latency_seconds_count") == 1.0
    assert value(stats, "vllm:request_queue_time_seconds_count") == 0.0
    assert value(stats, "vllm:request_success_total", finished_reason="abort") == 1.0


def test_overhead_histogram(stats):
    stats.observe_overhead(0.003)
    stats.observe_overhead(0.03)
    name = "vllm:request_server_overhead_seconds"

    def server(sample: str, **labels) -> float | None:  # the API server's: no engine label
        return stats.registry.get_sample_value(sample, {"model_name": MODEL, **labels})

    assert server(name + "_count") == 2.0
    assert server(name + "_bucket", le="0.002") == 0.0
    assert server(name + "_bucket", le="0.005") == 1.0
    assert server(name + "_bucket", le="0.05") == 2.0
    assert value(stats, name + "_count") is None


def test_exposition_text_has_vllm_names_with_the_model_label(stats):
    stats.record(core(sched_stats(running=2, waiting=1, usage=0.75, queries=8, hits=4, pins=1)), [])
    stats.record(core(), [finished("a", 3, "stop", RequestMetrics(0.0, 0.5, 0.5, 0.5))])
    lines = set(generate_latest(stats.registry).decode().splitlines())
    for line in (
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="smol"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="smol"} 1.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.75',
        "# TYPE vllm:prefix_cache_queries_total counter",  # 0.0.4 text format
        'vllm:prefix_cache_queries_total{engine="0",model_name="smol"} 8.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="smol"} 4.0',
        'vllm:num_preemptions_total{engine="0",model_name="smol"} 0.0',
        'vllm:pins_total{engine="0",model_name="smol"} 1.0',
        'vllm:prompt_tokens_total{engine="0",model_name="smol"} 3.0',
        'vllm:request_success_total{engine="0",finished_reason="stop",model_name="smol"} 1.0',
        "# TYPE vllm:time_to_first_token_seconds histogram",
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="smol"} 1.0',
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="smol"} 1.0',
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="smol"} 1.0',
    ):
        assert line in lines, line


def test_each_engine_counts_its_own_stats_and_requests():
    stats = PrometheusStatLogger(MODEL, registry=CollectorRegistry(), num_engines=2)
    # Every engine's series exist from the start (vLLM's engine label, "0" and "1").
    assert value(stats, "vllm:num_requests_running", engine="1") == 0.0
    own = sched_stats(running=3, waiting=1, preemptions=2)
    both = sched_stats(running=5, waiting=1, preemptions=2)  # the gauges over both ranks
    msg = core(both, {"r": 2})
    msg.engine_index, msg.engine_stats = 1, own
    stats.record(msg, [finished("r", 3, "stop", RequestMetrics(0.0, 0.5, 0.5, 0.5))])
    assert value(stats, "vllm:num_requests_running", engine="1") == 3.0  # rank 1's own
    assert value(stats, "vllm:num_requests_running", engine="0") == 0.0
    assert value(stats, "vllm:num_preemptions_total", engine="1") == 2.0
    assert value(stats, "vllm:generation_tokens_total", engine="1") == 2.0
    assert value(stats, "vllm:time_to_first_token_seconds_count", engine="1") == 1.0
    assert value(stats, "vllm:time_to_first_token_seconds_count", engine="0") == 0.0
    stats.mark_engine_dead()
    assert value(stats, "vllm:num_requests_running", engine="1") == 0.0
    assert value(stats, "vllm:engine_alive", engine="0") == 0.0


def test_loggers_with_separate_registries_do_not_share_values():
    a = PrometheusStatLogger("a", registry=CollectorRegistry())
    b = PrometheusStatLogger("b")  # its own fresh registry by default
    a.record(core(sched_stats(preemptions=4)), [])
    assert a.registry is not b.registry
    name, engine = "vllm:num_preemptions_total", {"engine": "0"}
    assert a.registry.get_sample_value(name, {"model_name": "a", **engine}) == 4.0
    assert b.registry.get_sample_value(name, {"model_name": "b", **engine}) == 0.0


def test_context_serve_policy_stats(stats):
    from collections import Counter

    from vllm_continuum.context_serve.stats import ContextServeStats

    first = sched_stats()
    first.policy_name = "context_serve"
    first.policy_stats = ContextServeStats(
        decisions=Counter({("fast", "rules"): 2, ("slow", "bayes"): 1}),
        prediction_errors_s=[0.3, 7.0],
        fast_pin_outcomes=Counter({"hit": 1, "expired": 1}),
        regret=Counter({"slow_was_fast": 1}),
        trainings=1,
    )
    second = sched_stats()
    second.policy_name = "context_serve"
    second.policy_stats = ContextServeStats(
        decisions=Counter({("fast", "rules"): 1}), training_failures=1
    )
    stats.record(core(first), [])
    stats.record(core(second), [])
    stats.record(core(sched_stats()), [])  # a policy without stats: nothing changes
    decisions = "vllm:context_serve_decisions_total"
    assert value(stats, decisions, speed="fast", layer="rules") == 3.0
    assert value(stats, decisions, speed="slow", layer="bayes") == 1.0
    err = "vllm:context_serve_prediction_error_seconds"
    assert value(stats, err + "_count") == 2.0
    assert value(stats, err + "_bucket", le="0.5") == 1.0
    assert value(stats, err + "_bucket", le="10.0") == 2.0
    pins = "vllm:context_serve_fast_pins_total"
    assert value(stats, pins, outcome="hit") == 1.0 and value(stats, pins, outcome="expired") == 1
    assert value(stats, "vllm:context_serve_regret_total", kind="slow_was_fast") == 1.0
    assert value(stats, "vllm:context_serve_trainings_total", result="ok") == 1.0
    assert value(stats, "vllm:context_serve_trainings_total", result="failed") == 1.0
    text = generate_latest(stats.registry).decode()
    assert (
        'vllm:context_serve_decisions_total{engine="0",layer="rules",model_name="smol",'
        'speed="fast"} 3.0' in text
    )


class GaugePolicy(FCFSPolicy):
    """A policy declaring its own series (registered in the test below)."""

    name = "gauge_test"

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return (
            MetricSpec("vllm:test_depth", "gauge", "Depth.", read=value_of("depth")),
            MetricSpec(
                "vllm:test_events", "counter", "Events.", labels=("kind",), read=by_label("events")
            ),
            MetricSpec(
                "vllm:test_delay_seconds",
                "histogram",
                "Delays.",
                buckets=(1.0, 10.0),
                read=each_of("delays"),
            ),
        )


def test_a_policys_declared_metrics_reach_the_metrics_page(monkeypatch):
    """Only declarations: the logger builds the series from the registry's policy classes
    and feeds a report's ``policy_stats`` to the series of the policy it names."""
    from types import SimpleNamespace

    from vllm_continuum.policy import registry

    monkeypatch.setitem(registry._REGISTRY, "gauge_test", f"{__name__}:GaugePolicy")
    stats = PrometheusStatLogger(MODEL, registry=CollectorRegistry())
    report = sched_stats()
    report.policy_name = "gauge_test"
    report.policy_stats = SimpleNamespace(depth=3, events={"a": 2, "b": 1}, delays=[0.5, 5.0])
    stats.record(core(report), [])
    report.policy_stats = SimpleNamespace(depth=4, events={"a": 1}, delays=[])
    stats.record(core(report), [])
    other = sched_stats()  # another policy's report feeds none of these series
    other.policy_name = "fcfs"
    other.policy_stats = SimpleNamespace(depth=99, events={"a": 99}, delays=[99.0])
    stats.record(core(other), [])
    text = generate_latest(stats.registry).decode()
    assert "# TYPE vllm:test_depth gauge" in text
    assert 'vllm:test_depth{engine="0",model_name="smol"} 4.0' in text
    assert 'vllm:test_events_total{engine="0",kind="a",model_name="smol"} 3.0' in text
    assert 'vllm:test_events_total{engine="0",kind="b",model_name="smol"} 1.0' in text
    assert 'vllm:test_delay_seconds_bucket{engine="0",le="1.0",model_name="smol"} 1.0' in text
    assert 'vllm:test_delay_seconds_count{engine="0",model_name="smol"} 2.0' in text
    # The built-in policies' series are there too (declared, not yet fed).
    assert "# TYPE vllm:context_serve_decisions_total counter" in text


def test_the_front_end_reads_declarations_without_loading_the_predictors():
    """The logger imports every registered policy class for its ``metrics()``: none of
    them may pull in numpy/scipy (ContextServe's predictors load with the policy's core)."""
    probe = (
        "import sys; from vllm.v1.metrics.prometheus import PrometheusStatLogger; "
        "PrometheusStatLogger('m'); print(sorted(m for m in ('scipy', 'xgboost') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stderr


def test_custom_histogram_buckets_replace_a_familys_defaults():
    from vllm.config import HISTOGRAM_FAMILIES
    from vllm.v1.metrics.prometheus import BUCKET_FAMILIES, PrometheusStatLogger

    custom = {"request_latency": [0.05, 0.5, 5.0], "request_tokens": [10, 100]}
    text = PrometheusStatLogger("m", custom_buckets=custom).exposition().decode()
    e2e = [
        line
        for line in text.splitlines()
        if line.startswith("vllm:e2e_request_latency_seconds_bucket")
    ]
    assert [line.split('le="')[1].split('"')[0] for line in e2e] == ["0.05", "0.5", "5.0", "+Inf"]
    prompt = [
        line for line in text.splitlines() if line.startswith("vllm:request_prompt_tokens_bucket")
    ]
    assert len(prompt) == 3
    # A family not named keeps its defaults.
    ttft = [
        line
        for line in text.splitlines()
        if line.startswith("vllm:time_to_first_token_seconds_bucket")
    ]
    assert len(ttft) > 4
    assert set(BUCKET_FAMILIES) == set(HISTOGRAM_FAMILIES)  # the flag's and the logger's


@pytest.mark.parametrize(
    ("custom", "named"),
    [
        ({"request_latency": [1, 0.5]}, "strictly increasing"),
        ({"request_latency": []}, "non-empty"),
        ({"request_latency": [0, 1]}, "greater than 0"),
        ({"request_latency": [1, float("inf")]}, "finite"),
        ({"request_latency": [True, 2]}, "must be a number"),
        ({"latency": [1, 2]}, "not a bucket family"),
        ({"request_num_preemptions": [1, 2]}, "no vllm:request_num_preemptions"),
    ],
)
def test_bad_custom_buckets_are_refused(custom, named):
    from vllm.config import ObservabilityConfig

    with pytest.raises(ValueError, match=named):
        ObservabilityConfig(custom_histogram_buckets=custom)
