"""Prometheus collectors with vLLM's metric names, labelled ``model_name``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm.outputs import RequestOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import PolicyStats

_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
    640.0,
)
_TPOT_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_TOOL_ERROR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class PrometheusStatLogger:
    """Turns engine stats and finished requests into metrics in its own registry.

    Gauges come from each step's ``SchedulerStats``, counters from its deltas, histograms
    from the timings of finished requests. One registry per server, so tests can run
    several servers (or loggers) in one process.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, ["model_name"], registry=self.registry).labels(**self.labels)

        def counter(name, doc):
            return Counter(name, doc, ["model_name"], registry=self.registry).labels(**self.labels)

        def histogram(name, doc, buckets):
            return Histogram(
                name, doc, ["model_name"], buckets=buckets, registry=self.registry
            ).labels(**self.labels)

        self.engine_alive = gauge(
            "vllm:engine_alive",
            "1 while the engine process serves; 0 once it died (the gauges of its state "
            "are 0 from then on).",
        )
        self.engine_alive.set(1)
        self._engine_dead = False
        self.running = gauge("vllm:num_requests_running", "Requests in model execution.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent usage."
        )
        self.pinned_requests = gauge(
            "vllm:num_pinned_requests", "Finished requests whose KV blocks are pinned."
        )
        self.pinned_blocks = gauge("vllm:pinned_kv_blocks", "KV blocks held by pins.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens.")
        self.pins = counter("vllm:pins", "KV pins placed (Continuum).")
        self.pin_hits = counter("vllm:pin_hits", "Next turns that found their pinned blocks.")
        self.pin_expiries = counter("vllm:pin_expiries", "Pins released by TTL expiry.")
        self.pin_forced = counter(
            "vllm:pin_forced_releases", "Pins released under memory pressure."
        )
        # The CPU KV tier (vLLM's names for its external prefix cache).
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries", "CPU KV tier queries, in tokens."
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "CPU KV tier hits (tokens loaded), in tokens."
        )
        self.offload_usage = gauge(
            "vllm:kv_offload_usage_perc", "CPU KV tier usage: 1 means 100 percent usage."
        )
        self.offload_saved = counter("vllm:kv_offload_blocks_saved", "KV blocks saved to the tier.")
        self.offload_loaded = counter(
            "vllm:kv_offload_blocks_loaded", "KV blocks loaded back from the tier."
        )
        self.offload_bytes = counter(
            "vllm:kv_offload_bytes", "Bytes copied between the KV cache and the CPU tier."
        )
        self.success = Counter(
            "vllm:request_success",
            "Successfully finished requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds", "Time per output token.", _TPOT_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end latency.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time spent waiting in the engine.", _LATENCY_BUCKETS
        )
        self._add_policy_metrics(histogram)
        self.overhead = histogram(
            "vllm:request_server_overhead_seconds",
            "Server latency minus the time in the engine process (HTTP, tokenization, ZMQ, "
            "detokenization).",
            _OVERHEAD_BUCKETS,
        )

    def _add_policy_metrics(self, histogram) -> None:
        """ContextServe's series (they appear once the policy reports something)."""

        def labelled(name, doc, label):
            return Counter(name, doc, ["model_name", label], registry=self.registry)

        self.cs_decisions = Counter(
            "vllm:context_serve_decisions",
            "ContextServe verdicts on finished turns, by speed class and deciding layer.",
            ["model_name", "speed", "layer"],
            registry=self.registry,
        )
        self.cs_error = histogram(
            "vllm:context_serve_prediction_error_seconds",
            "|observed - predicted| tool time of verdicts that predicted one.",
            _TOOL_ERROR_BUCKETS,
        )
        self.cs_fast_pins = labelled(
            "vllm:context_serve_fast_pins", "How FAST (strict) pins ended.", "outcome"
        )
        self.cs_regret = labelled(
            "vllm:context_serve_regret",
            "Verdicts the measured tool time proved wrong (slow_was_fast, fast_was_slow).",
            "kind",
        )
        self.cs_trainings = labelled(
            "vllm:context_serve_trainings", "Background XGBoost trainings.", "result"
        )

    def _record_policy(self, p: PolicyStats) -> None:
        for (speed, layer), n in p.decisions.items():
            self.cs_decisions.labels(speed=speed, layer=layer, **self.labels).inc(n)
        for err in p.prediction_errors_s:
            self.cs_error.observe(err)
        for outcome, n in p.fast_pin_outcomes.items():
            self.cs_fast_pins.labels(outcome=outcome, **self.labels).inc(n)
        for kind, n in p.regret.items():
            self.cs_regret.labels(kind=kind, **self.labels).inc(n)
        for result, n in (("ok", p.trainings), ("failed", p.training_failures)):
            if n:
                self.cs_trainings.labels(result=result, **self.labels).inc(n)

    def observe_overhead(self, seconds: float) -> None:
        self.overhead.observe(seconds)

    def mark_engine_dead(self) -> None:
        """The engine process is gone (the server kept alive): nothing runs, waits, is
        pinned or held in a KV cache any more, so those gauges read 0 instead of freezing
        at their last values, and ``vllm:engine_alive`` is 0. Counters and histograms keep
        their totals. Idempotent; a later ``record`` (a message sent before the death) still
        counts its events but leaves the gauges at 0."""
        self._engine_dead = True
        self.engine_alive.set(0)
        for g in self._state_gauges():
            g.set(0)

    def _state_gauges(self) -> list:
        return [
            self.running,
            self.waiting,
            self.kv_usage,
            self.pinned_requests,
            self.pinned_blocks,
            self.offload_usage,
        ]

    def record(self, core: EngineCoreOutputs, results: list[RequestOutput]) -> None:
        s = core.scheduler_stats
        if s is not None:
            self.running.set(s.num_running_reqs)
            self.waiting.set(s.num_waiting_reqs)
            self.kv_usage.set(s.kv_cache_usage)
            self.prefix_queries.inc(s.prefix_cache_stats.queries)
            self.prefix_hits.inc(s.prefix_cache_stats.hits)
            self.preemptions.inc(s.num_preemptions)
            p = s.pin_stats
            self.pinned_requests.set(p.num_pinned_requests)
            self.pinned_blocks.set(p.pinned_kv_blocks)
            self.pins.inc(p.pins)
            self.pin_hits.inc(p.pin_hits)
            self.pin_expiries.inc(p.expiries)
            self.pin_forced.inc(p.forced_releases)
            if s.policy_stats is not None:
                self._record_policy(s.policy_stats)
            self._record_offload(s)
        self.generation_tokens.inc(sum(len(o.new_token_ids) for o in core.outputs))
        for out in results:
            if out.finished:
                self._record_finished(out)
        if self._engine_dead:  # a message sent before the death, handled after it
            self.mark_engine_dead()

    def _record_offload(self, s) -> None:
        if s.connector_prefix_cache_stats is not None:
            self.external_queries.inc(s.connector_prefix_cache_stats.queries)
            self.external_hits.inc(s.connector_prefix_cache_stats.hits)
        o = s.offload_stats
        if o is not None:
            self.offload_usage.set(o.usage)
            self.offload_saved.inc(o.blocks_saved)
            self.offload_loaded.inc(o.blocks_loaded)
            self.offload_bytes.inc(o.bytes_moved)

    def _record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        reason = out.outputs[0].finish_reason or "abort" if out.outputs else "abort"
        self.success.labels(finished_reason=reason, **self.labels).inc()
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.num_generation_tokens > 1 and m.last_token_time is not None:
                self.tpot.observe(
                    (m.last_token_time - m.first_token_time) / (m.num_generation_tokens - 1)
                )
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
