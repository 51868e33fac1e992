"""Statistics the engine core reports each step (consumed by the Prometheus loggers)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Counts since the previous report (deltas, not totals)."""

    requests: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache
    reset: bool = False


@dataclass
class PinStats:
    """Pin counters since the previous report (deltas), plus current gauges."""

    num_pinned_requests: int = 0  # gauge
    pinned_kv_blocks: int = 0  # gauge
    pins: int = 0
    pin_hits: int = 0  # a job's next turn found its pinned blocks
    expiries: int = 0  # TTL ran out
    forced_releases: int = 0  # released under memory pressure


@dataclass
class OffloadStats:
    """The CPU KV tier: usage (gauge) and copies since the previous report (deltas)."""

    usage: float = 0.0  # used tier blocks / tier blocks
    blocks_saved: int = 0  # KV cache -> tier
    blocks_loaded: int = 0  # tier -> KV cache
    bytes_moved: int = 0  # both directions


@dataclass
class KVTransferStats:
    """Disaggregated prefill (--kv-transfer-config): holds and fetches now (gauges) and,
    since the previous report (deltas), the blocks that moved and what went wrong."""

    held_requests: int = 0  # producer: finished prefills whose blocks wait for a fetch
    fetching_requests: int = 0  # consumer: requests waiting for their blocks
    blocks_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    fetch_seconds: float = 0.0  # summed over the fetches that ended
    failed_fetches: int = 0
    expired_holds: int = 0  # producer: holds no consumer fetched in time


@dataclass
class StateCheckpointStats:
    """A recurrent model's checkpoints of recurrent states (state_checkpoints.py):
    the cache's size (gauge) and, since the previous report (deltas), the states saved at
    block boundaries, the prefix hits restored from one, and the checkpoints evicted; with
    the CPU KV tier, the checkpoints it holds (gauge) and those copied to it (delta)."""

    cached: int = 0
    saves: int = 0
    restores: int = 0
    evictions: int = 0
    offloaded: int = 0
    offloads: int = 0


@dataclass
class SpecDecodingStats:
    """Speculative decoding since the previous report (deltas)."""

    num_drafts: int = 0  # request-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts kept at position i of their step (vLLM's accepted tokens per position).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafts: int, accepted: int) -> None:
        """One request-step with ``num_drafts`` drafts of which the first ``accepted``
        were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_drafts - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1

    def add(self, other: SpecDecodingStats) -> None:
        """Sum ``other`` (another step's, or interval's) into these."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for i, n in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[i] += n


@dataclass(frozen=True)
class KVCacheEvictionEvent:
    """One sampled KV cache block's life, ended by its eviction (--kv-cache-metrics):
    seconds from its allocation to the eviction, from its last access (a prefix hit, else
    the allocation) to the eviction, and between its last (at most four) prefix hits."""

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...] = ()


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # 1 - free / (num_blocks - 1)
    num_preemptions: int = 0  # delta since the previous report
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    pin_stats: PinStats = field(default_factory=PinStats)
    # From ``Policy.make_stats``: read by the metrics ``policy_name``'s class declares.
    policy_stats: object | None = None
    policy_name: str = ""
    # The CPU KV tier's lookups (vLLM's external prefix cache) and copies; None: no tier.
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    offload_stats: OffloadStats | None = None
    # --kv-transfer-config's connector; None without.
    kv_transfer_stats: KVTransferStats | None = None
    # A model with recurrent layers, with prefix caching; None otherwise.
    state_checkpoint_stats: StateCheckpointStats | None = None
    # Tokens the step computed (prompt chunks and decodes); 0: a report without a step.
    num_scheduled_tokens: int = 0
    spec_decoding_stats: SpecDecodingStats | None = None  # None: no speculative decoding
    # --enable-lora: adapter name -> its requests, running and waiting (vLLM's fields).
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # --kv-cache-metrics: the sampled blocks evicted since the previous report.
    kv_cache_eviction_events: list[KVCacheEvictionEvent] = field(default_factory=list)
