"""The periodic log line of a serving engine, as vLLM's ``LoggingStatLogger`` writes it:

    Engine 000: Avg prompt throughput: 1540.3 tokens/s, Avg generation throughput: 812.0
    tokens/s, Running: 16 reqs, Waiting: 3 reqs, GPU KV cache usage: 41.2%, Prefix cache
    hit rate: 63.5%

every ``VLLM_LOG_STATS_INTERVAL`` seconds (10) in which the engine worked (``run``: the
server's timer; an interval with no step and no request held logs nothing). Prompt
throughput counts each request's prompt once, when its first token comes back (cached
tokens included, as vLLM's); the hit
rate is over the prompt tokens looked up in the interval; the KV usage and the queues are
the latest step's. With a host-memory KV tier the line adds its usage and hit rate.
``vllm serve --disable-log-stats`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from vllm import envs
from vllm.outputs import RequestOutput
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


class LoggingStatLogger:
    """A stat logger (``record(core_outputs, results, inter_token_latencies)``, as
    ``PrometheusStatLogger``) that logs the throughput line. ``clock``: monotonic seconds
    (tests pass a fake)."""

    def __init__(
        self, interval_s: float | None = None, clock: Callable[[], float] = time.monotonic
    ):
        self.interval_s = envs.VLLM_LOG_STATS_INTERVAL if interval_s is None else interval_s
        self.clock = clock
        self._reset(clock())
        self._running = self._waiting = 0
        self._kv_usage = 0.0
        self._tier_usage: float | None = None

    def _reset(self, now: float) -> None:
        self._since = now
        self._active = False
        self._prompt_tokens = self._generation_tokens = 0
        self._queries = self._hits = 0
        self._tier_queries = self._tier_hits = 0
        self._spec: SpecDecodingStats | None = None  # summed over the interval

    def record(
        self,
        core: EngineCoreOutputs,
        results: list[RequestOutput],
        inter_token_latencies: list[float] | None = None,
    ) -> None:
        for o in core.outputs:
            self._generation_tokens += len(o.new_token_ids)
            if o.num_prompt_tokens is not None:  # the request's first token: prompt done
                self._prompt_tokens += o.num_prompt_tokens
        s = core.scheduler_stats
        if s is not None:
            self._running, self._waiting = s.num_running_reqs, s.num_waiting_reqs
            self._kv_usage = s.kv_cache_usage
            self._queries += s.prefix_cache_stats.queries
            self._hits += s.prefix_cache_stats.hits
            tier = s.connector_prefix_cache_stats
            if tier is not None:
                self._tier_queries += tier.queries
                self._tier_hits += tier.hits
            if s.offload_stats is not None:
                self._tier_usage = s.offload_stats.usage
            spec = s.spec_decoding_stats
            if spec is not None and spec.num_drafts:
                self._spec = self._spec or SpecDecodingStats()
                self._spec.add(spec)
        self._active = True

    async def run(self) -> None:
        """Every ``interval_s``: the line, if the engine worked (cancel to stop)."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.log_if_active()

    def log_if_active(self) -> None:
        """The line for the interval just ended if a step ran in it or requests are held
        (a stalled engine shows its queue); else start the next interval silently."""
        if self._active or self._running or self._waiting:
            self.log()
        else:
            self._reset(self.clock())

    def log(self, now: float | None = None) -> None:
        """Write the line for the interval up to ``now`` and start the next one."""
        now = self.clock() if now is None else now
        elapsed = max(now - self._since, 1e-9)
        line = (
            f"Engine 000: Avg prompt throughput: {self._prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {self._generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {self._running} reqs, Waiting: {self._waiting} reqs, "
            f"GPU KV cache usage: {self._kv_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {_rate(self._hits, self._queries):.1f}%"
        )
        if self._tier_usage is not None:
            line += (
                f", KV tier usage: {self._tier_usage * 100:.1f}%, "
                f"KV tier hit rate: {_rate(self._tier_hits, self._tier_queries):.1f}%"
            )
        logger.info("%s", line)
        if self._spec is not None:
            spec = self._spec
            drafts, proposed, accepted = (
                spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens
            )  # fmt: skip
            # vLLM's: each position's kept drafts over the steps that had drafts.
            per_pos = ", ".join(f"{n / drafts:.3f}" for n in spec.num_accepted_tokens_per_pos)
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted: %d tokens, "
                "Drafted: %d tokens, Draft acceptance rate: %.1f%%, Per-position acceptance "
                "rate: %s",
                1 + accepted / drafts,
                accepted,
                proposed,
                _rate(accepted, proposed),
                per_pos,
            )
        self._reset(now)


def _rate(hits: int, queries: int) -> float:
    return 100.0 * hits / queries if queries else 0.0
