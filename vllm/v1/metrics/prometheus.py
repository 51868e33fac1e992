"""Prometheus collectors with vLLM's metric names, labelled ``model_name`` and, as in vLLM,
``engine`` (the data-parallel rank whose stats or requests a sample counts; "0" with one
engine). The API server's own series (``FRONTEND_ONLY``) have no ``engine`` label.

Every series is a ``MetricSpec`` (``vllm_continuum.metrics``): the engine's in the tables
below, a policy's in its class; ``build_series`` creates them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from vllm.outputs import RequestOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.admission_control import ADMISSION_REASONS
from vllm_continuum.metrics import MetricSpec, Reader, Sample, merge_specs
from vllm_continuum.pins import PIN_METRICS
from vllm_continuum.policy.registry import policy_metrics

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
# vLLM's inter-token latency buckets.
_ITL_BUCKETS = (
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
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def iteration_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Tokens a step computes: powers of two from 1 up to the step budget, and it."""
    out = [1, *(2**k for k in range(3, 20) if 2**k < max_num_batched_tokens)]
    return (*out, max_num_batched_tokens)


def _stat(path: str) -> Reader:
    """One unlabelled sample: the ``SchedulerStats`` attribute at dotted ``path``; none
    when a part is None (a report without a CPU tier has no tier figures)."""

    def read(stats: Any) -> list[Sample]:
        for part in path.split("."):
            stats = getattr(stats, part)
            if stats is None:
                return []
        return [((), stats)]

    return read


def _within(path: str, spec: MetricSpec) -> MetricSpec:
    """``spec`` reading the ``SchedulerStats`` attribute ``path`` (none when it is None)."""

    def read(stats: Any) -> list[Sample]:
        inner = getattr(stats, path)
        return [] if inner is None else spec.read(inner)

    return replace(spec, read=read)


def _gauge(name: str, doc: str, path: str) -> MetricSpec:
    return MetricSpec(name, "gauge", doc, read=_stat(path))


def _counter(name: str, doc: str, path: str) -> MetricSpec:
    return MetricSpec(name, "counter", doc, read=_stat(path))


# Series read from each step's ``SchedulerStats``: gauges set, counters add the deltas.
# Its gauges are the engine's state (0 once the engine died).
SCHEDULER_METRICS = (
    _gauge("vllm:num_requests_running", "Requests in model execution.", "num_running_reqs"),
    _gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", "num_waiting_reqs"),
    _gauge(
        "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent usage.", "kv_cache_usage"
    ),
    _counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in tokens.",
        "prefix_cache_stats.queries",
    ),
    _counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", "prefix_cache_stats.hits"),
    _counter("vllm:num_preemptions", "Cumulative preemptions.", "num_preemptions"),
    # The pins' series, declared with the pin mechanism (shared with the plugin).
    *(_within("pin_stats", spec) for spec in PIN_METRICS),
    # The CPU KV tier (vLLM's names for its external prefix cache).
    _counter(
        "vllm:external_prefix_cache_queries",
        "CPU KV tier queries, in tokens.",
        "connector_prefix_cache_stats.queries",
    ),
    _counter(
        "vllm:external_prefix_cache_hits",
        "CPU KV tier hits (tokens loaded), in tokens.",
        "connector_prefix_cache_stats.hits",
    ),
    _gauge(
        "vllm:kv_offload_usage_perc",
        "CPU KV tier usage: 1 means 100 percent usage.",
        "offload_stats.usage",
    ),
    _counter(
        "vllm:kv_offload_blocks_saved", "KV blocks saved to the tier.", "offload_stats.blocks_saved"
    ),
    _counter(
        "vllm:kv_offload_blocks_loaded",
        "KV blocks loaded back from the tier.",
        "offload_stats.blocks_loaded",
    ),
    _counter(
        "vllm:kv_offload_bytes",
        "Bytes copied between the KV cache and the CPU tier.",
        "offload_stats.bytes_moved",
    ),
    # Disaggregated prefill (--kv-transfer-config); none without it.
    _gauge(
        "vllm:kv_transfer_held_requests",
        "Finished prefills whose KV blocks are held for a consumer's fetch.",
        "kv_transfer_stats.held_requests",
    ),
    _gauge(
        "vllm:kv_transfer_fetching_requests",
        "Requests waiting for their KV blocks from a producer.",
        "kv_transfer_stats.fetching_requests",
    ),
    _counter(
        "vllm:kv_transfer_blocks_sent",
        "KV blocks sent to consumers.",
        "kv_transfer_stats.blocks_sent",
    ),
    _counter(
        "vllm:kv_transfer_blocks_received",
        "KV blocks fetched from producers.",
        "kv_transfer_stats.blocks_received",
    ),
    _counter(
        "vllm:kv_transfer_bytes_received",
        "Bytes of KV fetched from producers.",
        "kv_transfer_stats.bytes_received",
    ),
    _counter(
        "vllm:kv_transfer_fetch_seconds",
        "Seconds requests waited for their KV blocks, summed.",
        "kv_transfer_stats.fetch_seconds",
    ),
    _counter(
        "vllm:kv_transfer_failed_fetches",
        "Fetches of KV blocks that failed.",
        "kv_transfer_stats.failed_fetches",
    ),
    _counter(
        "vllm:kv_transfer_expired_holds",
        "Held prefills no consumer fetched in time (vLLM's nixl_num_kv_expired_reqs).",
        "kv_transfer_stats.expired_holds",
    ),
    # A recurrent model's checkpoints of recurrent states (prefix hits restart from
    # them: state_checkpoints.py); none for other models.
    _gauge(
        "vllm:recurrent_state_checkpoints",
        "Checkpoints of recurrent states cached for prefix hits.",
        "state_checkpoint_stats.cached",
    ),
    _counter(
        "vllm:recurrent_state_checkpoint_saves",
        "Recurrent states copied at a block boundary.",
        "state_checkpoint_stats.saves",
    ),
    _counter(
        "vllm:recurrent_state_checkpoint_restores",
        "Prefix hits restarted from a checkpoint of recurrent states.",
        "state_checkpoint_stats.restores",
    ),
    _counter(
        "vllm:recurrent_state_checkpoint_evictions",
        "Checkpoints of recurrent states evicted for room.",
        "state_checkpoint_stats.evictions",
    ),
    _gauge(
        "vllm:recurrent_state_checkpoints_offloaded",
        "Checkpoints of recurrent states held in the CPU tier.",
        "state_checkpoint_stats.offloaded",
    ),
    _counter(
        "vllm:recurrent_state_checkpoint_offloads",
        "Evicted checkpoints of recurrent states copied to the CPU tier.",
        "state_checkpoint_stats.offloads",
    ),
    # Speculative decoding (vLLM's names); none without --speculative-config.
    _counter(
        "vllm:spec_decode_num_drafts",
        "Request-steps that carried draft tokens.",
        "spec_decoding_stats.num_drafts",
    ),
    _counter(
        "vllm:spec_decode_num_draft_tokens",
        "Draft tokens proposed.",
        "spec_decoding_stats.num_draft_tokens",
    ),
    _counter(
        "vllm:spec_decode_num_accepted_tokens",
        "Draft tokens accepted.",
        "spec_decoding_stats.num_accepted_tokens",
    ),
)

# vLLM's kv_cache_residency buckets: millisecond reuse gaps up to 30-minute lifetimes.
# fmt: off
KV_CACHE_RESIDENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
    600, 1200, 1800,
)
# fmt: on


def _eviction_samples(values: Callable[[Any], Iterable[float]]) -> Reader:
    """The samples ``values`` gives for each of a report's ``kv_cache_eviction_events``."""
    return lambda stats: [((), v) for e in stats.kv_cache_eviction_events for v in values(e)]


_SAMPLED = " Sampled blocks (--kv-cache-metrics-sample)."
# --kv-cache-metrics (vLLM's series): from each report's sampled evictions.
KV_CACHE_RESIDENCY_METRICS = (
    MetricSpec(
        "vllm:kv_block_lifetime_seconds",
        "histogram",
        "KV cache block lifetime, from allocation to eviction." + _SAMPLED,
        buckets=KV_CACHE_RESIDENCY_BUCKETS,
        read=_eviction_samples(lambda e: (e.lifetime_seconds,)),
    ),
    MetricSpec(
        "vllm:kv_block_idle_before_evict_seconds",
        "histogram",
        "KV cache block idle time (since its last access) before eviction." + _SAMPLED,
        buckets=KV_CACHE_RESIDENCY_BUCKETS,
        read=_eviction_samples(lambda e: (e.idle_seconds,)),
    ),
    MetricSpec(
        "vllm:kv_block_reuse_gap_seconds",
        "histogram",
        "Time between consecutive accesses (prefix hits) of a KV cache block; its last few "
        "only." + _SAMPLED,
        buckets=KV_CACHE_RESIDENCY_BUCKETS,
        read=_eviction_samples(lambda e: e.reuse_gaps_seconds),
    ),
)

# Series the logger feeds itself (liveness, finished requests' timings, the front end's
# overhead): declared here, updated by name.
ENGINE_ALIVE = "vllm:engine_alive"
ENGINE_SLEEP_STATE = "vllm:engine_sleep_state"
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # awake, level 1, level 2
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
SUCCESS = "vllm:request_success"
TTFT = "vllm:time_to_first_token_seconds"
TPOT = "vllm:time_per_output_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
QUEUE_TIME = "vllm:request_queue_time_seconds"
OVERHEAD = "vllm:request_server_overhead_seconds"
ITL = "vllm:inter_token_latency_seconds"
REQUEST_TPOT = "vllm:request_time_per_output_token_seconds"
PREFILL_TIME = "vllm:request_prefill_time_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
INFERENCE_TIME = "vllm:request_inference_time_seconds"
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
MAX_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
PARAMS_N = "vllm:request_params_n"
PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
PROMPT_TOKENS_CACHED = "vllm:prompt_tokens_cached"
ITERATION_TOKENS = "vllm:iteration_tokens_total"
ADMISSION_REJECTIONS = "vllm:admission_rejections"
SPEC_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def request_metrics(max_model_len: int, max_num_batched_tokens: int) -> tuple[MetricSpec, ...]:
    """vLLM's per-request and per-step series whose buckets follow the model's limits.
    The phases are as the front end sees them: scheduled = arrival + the engine's queue
    time; prefill = first token - scheduled; decode = last token - first token."""
    tokens = buckets_1_2_5(max_model_len)
    return (
        MetricSpec(ITL, "histogram", "Inter-token latency.", buckets=_ITL_BUCKETS),
        MetricSpec(
            REQUEST_TPOT,
            "histogram",
            "Per request: mean time per output token after the first.",
            buckets=_ITL_BUCKETS,
        ),
        MetricSpec(
            PREFILL_TIME, "histogram", "Time in the prefill phase.", buckets=_LATENCY_BUCKETS
        ),
        MetricSpec(DECODE_TIME, "histogram", "Time in the decode phase.", buckets=_LATENCY_BUCKETS),
        MetricSpec(
            INFERENCE_TIME,
            "histogram",
            "Time from first scheduled to the last token (prefill and decode).",
            buckets=_LATENCY_BUCKETS,
        ),
        MetricSpec(
            REQUEST_PROMPT_TOKENS, "histogram", "Prompt tokens per request.", buckets=tokens
        ),
        MetricSpec(
            REQUEST_GENERATION_TOKENS,
            "histogram",
            "Generation tokens per request (all its sequences).",
            buckets=tokens,
        ),
        MetricSpec(
            MAX_GENERATION_TOKENS,
            "histogram",
            "Generation tokens of a request's longest sequence.",
            buckets=tokens,
        ),
        MetricSpec(PARAMS_N, "histogram", "The n request parameter.", buckets=_N_BUCKETS),
        MetricSpec(
            PARAMS_MAX_TOKENS, "histogram", "The max_tokens request parameter.", buckets=tokens
        ),
        MetricSpec(
            ITERATION_TOKENS,
            "histogram",
            "Tokens computed per engine step.",
            buckets=iteration_buckets(max_num_batched_tokens),
        ),
    )


FRONTEND_METRICS = (
    MetricSpec(
        ENGINE_ALIVE,
        "gauge",
        "1 while the engine process serves; 0 once it died (the gauges of its state are 0 "
        "from then on).",
    ),
    MetricSpec(
        ENGINE_SLEEP_STATE,
        "gauge",
        "Engine sleep state (vLLM's): awake = 1 while awake; weights_offloaded = 1 asleep at "
        "level 1; discard_all = 1 asleep at level 2.",
        labels=("sleep_state",),
    ),
    MetricSpec(
        ADMISSION_REJECTIONS,
        "counter",
        "Number of admission attempts rejected by a queue limit, by reason.",
        labels=("reason",),
    ),
    MetricSpec(
        SPEC_ACCEPTED_PER_POS,
        "counter",
        "Draft tokens accepted, by their position in the step's drafts (0: the first).",
        labels=("position",),
    ),
    MetricSpec(PROMPT_TOKENS, "counter", "Prefill tokens processed."),
    MetricSpec(PROMPT_TOKENS_CACHED, "counter", "Prompt tokens served from the prefix cache."),
    MetricSpec(GENERATION_TOKENS, "counter", "Generation tokens."),
    MetricSpec(SUCCESS, "counter", "Successfully finished requests.", labels=("finished_reason",)),
    MetricSpec(TTFT, "histogram", "Time to first token.", buckets=_LATENCY_BUCKETS),
    MetricSpec(TPOT, "histogram", "Time per output token.", buckets=_TPOT_BUCKETS),
    MetricSpec(E2E, "histogram", "End-to-end latency.", buckets=_LATENCY_BUCKETS),
    MetricSpec(
        QUEUE_TIME, "histogram", "Time spent waiting in the engine.", buckets=_LATENCY_BUCKETS
    ),
    MetricSpec(
        OVERHEAD,
        "histogram",
        "Server latency minus the time in the engine process (HTTP, tokenization, ZMQ, "
        "detokenization).",
        buckets=_OVERHEAD_BUCKETS,
    ),
)

# The API server's own series, which no engine's stats or requests feed: no engine label.
FRONTEND_ONLY = frozenset({ADMISSION_REJECTIONS, OVERHEAD})

LORA_INFO = "vllm:lora_requests_info"
_CLASSES = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}
_UPDATES = {"counter": "inc", "gauge": "set", "histogram": "observe"}


class MetricSeries:
    """The Prometheus series of one ``MetricSpec``: labelled ``model_name``, then
    ``engine`` (one value per engine in ``engines``) unless ``per_engine`` is False, then
    the spec's own labels."""

    def __init__(
        self,
        spec: MetricSpec,
        registry: CollectorRegistry,
        model_name: str,
        engines: tuple[str, ...] = ("0",),
        per_engine: bool = True,
    ) -> None:
        self.spec = spec
        extra: dict[str, Any] = {"buckets": spec.buckets} if spec.buckets is not None else {}
        if spec.kind == "gauge":
            # Several API servers (prometheus_client's multiprocess mode): a gauge reads
            # the value last set by any of them. Ignored in one process.
            extra["multiprocess_mode"] = "mostrecent"
        fixed = ["model_name", "engine"] if per_engine else ["model_name"]
        self.metric = _CLASSES[spec.kind](
            spec.name, spec.documentation, [*fixed, *spec.labels], registry=registry, **extra
        )
        self._fixed = {
            e: (model_name, e) if per_engine else (model_name,) for e in engines
        }  # the fixed label values, by engine
        # A series without labels of its own exists (at 0) from the start, each engine's.
        self._children = {} if spec.labels else {
            e: self.metric.labels(*values) for e, values in self._fixed.items()
        }  # fmt: skip
        self.child = self._children.get(engines[0])  # engine 0's (one engine: the only)

    def labels(self, *values: str, engine: str = "0") -> Any:
        """The child of ``engine`` for the spec's label ``values`` (none: the bound one)."""
        child = self._children.get(engine)
        if child is not None:
            return child
        return self.metric.labels(*self._fixed[engine], *values)

    def update(self, stats: Any, engine: str = "0") -> None:
        """Apply the spec's samples of one stats report of ``engine``."""
        for values, value in self.spec.samples(stats):
            getattr(self.labels(*values, engine=engine), _UPDATES[self.spec.kind])(value)


def build_series(
    specs: Iterable[MetricSpec],
    registry: CollectorRegistry,
    model_name: str,
    engines: tuple[str, ...] = ("0",),
) -> dict[str, MetricSeries]:
    """The one place series are created: one per spec, by name (ValueError when a name is
    declared twice, differently); ``engines``: the engine label's values."""
    return {
        s.name: MetricSeries(s, registry, model_name, engines, s.name not in FRONTEND_ONLY)
        for s in merge_specs([specs])
    }


# --custom-histogram-buckets' families (vLLM's keys): the histograms each one sets.
# vLLM's request_num_preemptions family has no histogram here.
BUCKET_FAMILIES: dict[str, tuple[str, ...]] = {
    "request_latency": (E2E, QUEUE_TIME, INFERENCE_TIME, PREFILL_TIME, DECODE_TIME),
    "time_to_first_token": (TTFT,),
    "inter_token_latency": (ITL, REQUEST_TPOT, TPOT),
    "iteration_tokens": (ITERATION_TOKENS,),
    "request_params_n": (PARAMS_N,),
    "request_tokens": (
        REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS, MAX_GENERATION_TOKENS,
        PARAMS_MAX_TOKENS,
    ),
    "kv_cache_residency": tuple(s.name for s in KV_CACHE_RESIDENCY_METRICS),
}  # fmt: skip


def with_buckets(
    specs: Iterable[MetricSpec], custom: dict[str, list[float]] | None
) -> list[MetricSpec]:
    """``specs`` with the buckets ``custom`` gives their families (the others as they are)."""
    by_name = {
        name: tuple(float(b) for b in bounds)
        for family, bounds in (custom or {}).items()
        for name in BUCKET_FAMILIES[family]
    }
    return [replace(s, buckets=by_name[s.name]) if s.name in by_name else s for s in specs]


class PrometheusStatLogger:
    """Turns engine stats and finished requests into metrics in its own registry.

    Every series is declared as a ``MetricSpec``: the engine's own here, each policy's by
    its class (``Policy.metrics()``, read from the registry: the front end does not know
    which policy the engine runs, so every registered policy's series exist, and a report
    feeds those of the policy it names). Gauges come from each step's ``SchedulerStats``,
    counters from its deltas, histograms from the timings of finished requests. One
    registry per server, so tests can run several servers (or loggers) in one process.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 8192,
        max_num_batched_tokens: int = 2048,
        max_loras: int = 0,
        engine_stats: bool = True,
        multiprocess: bool = False,
        kv_cache_metrics: bool = False,
        custom_buckets: dict[str, list[float]] | None = None,
        num_engines: int = 1,
    ) -> None:
        """``max_model_len`` and ``max_num_batched_tokens`` size the token-count buckets;
        ``max_loras`` > 0 (--enable-lora): vLLM's ``vllm:lora_requests_info``;
        ``kv_cache_metrics`` (--kv-cache-metrics): the KV cache residency histograms.
        ``custom_buckets`` (--custom-histogram-buckets): bucket bounds by family
        (``BUCKET_FAMILIES``), replacing the defaults of its histograms. ``num_engines``
        (--data-parallel-size): the ``engine`` label's values, "0" .. N-1; each engine's
        series exist from the start.

        Several API servers on one engine (``--api-server-count``) each get every step's
        stats but count only their own requests: one of them (``engine_stats``) records
        the engine's series, so those are counted once. ``multiprocess``: the values live
        in prometheus_client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, set
        before it was imported), and ``exposition`` sums every server's."""
        self.registry = registry or CollectorRegistry()
        self.engine_stats = engine_stats
        self.multiprocess = multiprocess
        self.engines = tuple(str(i) for i in range(num_engines))
        self._policy_specs = policy_metrics()
        policy_specs = merge_specs(self._policy_specs.values())
        per_request = request_metrics(max_model_len, max_num_batched_tokens)
        self._residency = KV_CACHE_RESIDENCY_METRICS if kv_cache_metrics else ()
        specs = (*FRONTEND_METRICS, *per_request, *SCHEDULER_METRICS, *self._residency)
        self.series = build_series(
            (*with_buckets(specs, custom_buckets), *policy_specs),
            self.registry, model_name, self.engines,
        )  # fmt: skip
        for engine in self.engines:
            self.series[ENGINE_ALIVE].labels(engine=engine).set(1)
        self.record_sleep_state(False)
        for reason in ADMISSION_REASONS:  # both series exist from the start, at 0
            self.series[ADMISSION_REJECTIONS].labels(reason)
        self._engine_dead = False
        self.max_loras = max_loras
        self.lora_info = None
        if max_loras:
            # As vLLM: the labels say which adapters run and wait (names joined by
            # commas), the value is when that was last so (seconds since the epoch); a
            # LoRA-aware router reads the newest series.
            self.lora_info = Gauge(
                LORA_INFO,
                "Running stats on LoRA requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
                multiprocess_mode="mostrecent",
            )

    def exposition(self) -> bytes:
        """The classic text format of every series (an OpenMetrics scrape would escape
        the colons): this registry's, or with ``multiprocess`` every server's, counters
        and histograms summed."""
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)

    def __getitem__(self, name: str) -> Any:
        """The child of an unlabelled series (engine 0's), e.g.
        ``stats["vllm:num_requests_running"]``."""
        return self.series[name].child

    def record_sleep_state(self, sleeping: bool, level: int = 0) -> None:
        """Sleep mode (vLLM's gauge; every engine sleeps and wakes together): asleep at
        level 0 (paused) all three read 0."""
        values = (0, int(level == 1), int(level == 2)) if sleeping else (1, 0, 0)
        for engine in self.engines:
            for state, value in zip(SLEEP_STATES, values, strict=True):
                self.series[ENGINE_SLEEP_STATE].labels(state, engine=engine).set(value)

    def record_admission_rejection(self, reason: str) -> None:
        """One request refused by ``--max-num-queued-reqs`` / ``--max-num-queued-tokens``
        (``reason``: the flag's field name, one of ``ADMISSION_REASONS``)."""
        self.series[ADMISSION_REJECTIONS].labels(reason).inc()

    def observe_overhead(self, seconds: float) -> None:
        self[OVERHEAD].observe(seconds)

    def mark_engine_dead(self) -> None:
        """The engine process is gone (the server kept alive): nothing runs, waits, is
        pinned or held in a KV cache any more, so those gauges read 0 instead of freezing
        at their last values, and ``vllm:engine_alive`` is 0. Counters and histograms keep
        their totals. Idempotent; a later ``record`` (a message sent before the death) still
        counts its events but leaves the gauges at 0."""
        self._engine_dead = True
        for engine in self.engines:
            self.series[ENGINE_ALIVE].labels(engine=engine).set(0)
            for spec in SCHEDULER_METRICS:
                if spec.kind == "gauge":
                    self.series[spec.name].labels(engine=engine).set(0)

    def record(
        self,
        core: EngineCoreOutputs,
        results: list[RequestOutput],
        inter_token_latencies: list[float] | None = None,
    ) -> None:
        """One engine message: its step's stats, the finished requests' timings, and the
        front end's ``inter_token_latencies`` for it (``OutputProcessor``'s), all counted
        for the engine that sent it (``core.engine_index``; its own stats, not the gauges
        over every engine that ``scheduler_stats`` holds under data parallelism)."""
        e = str(core.engine_index)
        s = core.engine_stats or core.scheduler_stats if self.engine_stats else None
        if s is not None:
            for spec in (*SCHEDULER_METRICS, *self._residency):
                self.series[spec.name].update(s, e)
            if s.num_scheduled_tokens > 0:
                self.series[ITERATION_TOKENS].labels(engine=e).observe(s.num_scheduled_tokens)
            if s.spec_decoding_stats is not None:
                per_pos = s.spec_decoding_stats.num_accepted_tokens_per_pos
                for pos, n in enumerate(per_pos):
                    self.series[SPEC_ACCEPTED_PER_POS].labels(str(pos), engine=e).inc(n)
            if s.policy_stats is not None:
                for spec in self._policy_specs.get(s.policy_name, ()):
                    self.series[spec.name].update(s.policy_stats, e)
            if self.lora_info is not None:
                self.lora_info.labels(
                    str(self.max_loras),
                    ",".join(s.waiting_lora_adapters),
                    ",".join(s.running_lora_adapters),
                ).set_to_current_time()

        def one(name: str) -> Any:
            return self.series[name].labels(engine=e)

        one(GENERATION_TOKENS).inc(sum(len(o.new_token_ids) for o in core.outputs))
        for seconds in inter_token_latencies or ():
            one(ITL).observe(seconds)
        for out in results:
            if out.finished:
                self._record_finished(out, e)
        if self._engine_dead:  # a message sent before the death, handled after it
            self.mark_engine_dead()

    def _record_finished(self, out: RequestOutput, engine: str = "0") -> None:
        def one(name: str) -> Any:
            return self.series[name].labels(engine=engine)

        m = out.metrics
        one(PROMPT_TOKENS).inc(len(out.prompt_token_ids))
        one(PROMPT_TOKENS_CACHED).inc(out.num_cached_tokens)
        one(REQUEST_PROMPT_TOKENS).observe(len(out.prompt_token_ids))
        reason = out.outputs[0].finish_reason or "abort" if out.outputs else "abort"
        self.series[SUCCESS].labels(reason, engine=engine).inc()
        if m is None:
            return
        one(REQUEST_GENERATION_TOKENS).observe(m.num_generation_tokens)
        one(MAX_GENERATION_TOKENS).observe(m.max_num_generation_tokens)
        one(PARAMS_N).observe(m.n)
        if m.max_tokens is not None:
            one(PARAMS_MAX_TOKENS).observe(m.max_tokens)
        if m.first_token_time is not None:
            one(TTFT).observe(m.first_token_time - m.arrival_time)
            if m.last_token_time is not None:
                decode = m.last_token_time - m.first_token_time
                one(DECODE_TIME).observe(decode)
                if m.num_generation_tokens > 1:
                    tpot = decode / (m.num_generation_tokens - 1)
                    one(TPOT).observe(tpot)
                    one(REQUEST_TPOT).observe(tpot)
            scheduled = m.scheduled_time
            if scheduled is not None:
                one(PREFILL_TIME).observe(max(m.first_token_time - scheduled, 0.0))
                if m.last_token_time is not None:
                    one(INFERENCE_TIME).observe(max(m.last_token_time - scheduled, 0.0))
        if m.finished_time is not None:
            one(E2E).observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            one(QUEUE_TIME).observe(m.queue_time)
