"""``LLM.get_metrics()``: the in-process engine's counters and gauges as vLLM's reader types
(``vllm.v1.metrics.reader``'s ``Counter``, ``Gauge``, ``Vector``), named as on /metrics
without the ``_total`` suffix, labelled ``model_name``. Totals since the ``LLM`` was made,
summed from every step's ``SchedulerStats``; the gauges are the last step's."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.metrics.stats import SchedulerStats, SpecDecodingStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Vector(Metric):
    """A counter per position (e.g. drafts kept at each position of a step's drafts)."""

    values: list[int]


@dataclass
class EngineTotals:
    """What ``LLM.get_metrics`` reports, fed one engine step at a time (``record``)."""

    counters: dict[str, int] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    spec: SpecDecodingStats = field(default_factory=SpecDecodingStats)

    def record(self, stats: SchedulerStats | None, generated_tokens: int) -> None:
        def add(name: str, n: int) -> None:
            self.counters[name] = self.counters.get(name, 0) + n

        add("vllm:generation_tokens", generated_tokens)
        if stats is None:
            return
        self.gauges["vllm:num_requests_running"] = stats.num_running_reqs
        self.gauges["vllm:num_requests_waiting"] = stats.num_waiting_reqs
        self.gauges["vllm:kv_cache_usage_perc"] = stats.kv_cache_usage
        add("vllm:num_preemptions", stats.num_preemptions)
        add("vllm:prefix_cache_queries", stats.prefix_cache_stats.queries)
        add("vllm:prefix_cache_hits", stats.prefix_cache_stats.hits)
        if stats.spec_decoding_stats is not None:
            self.spec.add(stats.spec_decoding_stats)

    def metrics(self, labels: dict[str, str], num_spec_tokens: int) -> list[Metric]:
        """Every series; with speculative decoding (``num_spec_tokens`` > 0) the
        spec-decode counters (0 before any draft) and the kept drafts per position."""
        out: list[Metric] = [Gauge(n, dict(labels), v) for n, v in self.gauges.items()]
        for name, value in self.counters.items():
            out.append(Counter(name, dict(labels), value))
        if num_spec_tokens:
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                value = getattr(self.spec, name)
                out.append(Counter(f"vllm:spec_decode_{name}", dict(labels), value))
            per_pos = self.spec.num_accepted_tokens_per_pos
            per_pos = (per_pos + [0] * num_spec_tokens)[:num_spec_tokens]
            name = "vllm:spec_decode_num_accepted_tokens_per_pos"
            out.append(Vector(name, dict(labels), per_pos))
        return out
