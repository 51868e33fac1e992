"""KV cache residency metrics (--kv-cache-metrics): how long sampled blocks live.

A sampled block's life, as the ``BlockPool`` reports it::

    allocated ──▶ accessed (prefix hit) ... accessed ──▶ evicted (reused for new data)
    birth          last 4 access times kept                  one KVCacheEvictionEvent

The metrics are about the KV cache's own blocks; the host-memory tier (kv_offload) keeps
its own copies and is not tracked. A Continuum pin keeps a block referenced, so it cannot
be evicted while pinned: pinned blocks live longer and are re-hit after shorter gaps.
"""

from __future__ import annotations

import random
from collections import deque
from typing import TYPE_CHECKING

from vllm.v1.metrics.stats import KVCacheEvictionEvent

if TYPE_CHECKING:
    from vllm.utils.clock import Clock
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

NUM_ACCESSES_KEPT = 4  # vLLM's ring: the reuse gaps of the last few hits only


class BlockMetricsState:
    """One sampled block since its allocation (clock seconds)."""

    __slots__ = ("access_history", "birth_time", "last_access")

    def __init__(self, now: float) -> None:
        self.birth_time = now
        self.last_access = now
        self.access_history: deque[float] = deque(maxlen=NUM_ACCESSES_KEPT)

    def record_access(self, now: float) -> None:
        self.last_access = now
        self.access_history.append(now)

    def eviction_event(self, now: float) -> KVCacheEvictionEvent:
        history = self.access_history
        gaps = tuple(b - a for a, b in zip(history, list(history)[1:], strict=False))
        return KVCacheEvictionEvent(now - self.birth_time, now - self.last_access, gaps)


class KVCacheMetricsCollector:
    """Samples blocks at allocation and records an event when a sampled block is evicted.

    Called by the ``BlockPool`` only when --kv-cache-metrics is on (the pool holds None
    otherwise). ``sample_rate`` in (0, 1]: the chance an allocation is tracked, drawn from
    a ``random.Random(seed)`` of its own (reproducible, and the global RNG is untouched).
    Time comes from ``clock`` (the scheduler's). Events wait in the collector until
    ``drain_events`` (each ``SchedulerStats``).
    """

    def __init__(self, sample_rate: float, clock: Clock, seed: int = 0) -> None:
        if isinstance(sample_rate, bool) or not 0 < sample_rate <= 1:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {sample_rate!r}")
        self.sample_rate = sample_rate
        self.clock = clock
        self._rng = random.Random(seed)
        self.block_metrics: dict[int, BlockMetricsState] = {}  # block_id -> its state
        self._eviction_events: list[KVCacheEvictionEvent] = []

    def should_sample_block(self) -> bool:
        return self.sample_rate >= 1 or self._rng.random() < self.sample_rate

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        """``block`` was taken for a new use: maybe start tracking it (a state left from an
        untracked earlier life is replaced)."""
        if self.should_sample_block():
            self.block_metrics[block.block_id] = BlockMetricsState(self.clock())
        else:
            self.block_metrics.pop(block.block_id, None)

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        """A prefix hit on ``block``."""
        state = self.block_metrics.get(block.block_id)
        if state is not None:
            state.record_access(self.clock())

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        """``block``'s data is dropped for reuse: its life ends (an event if tracked)."""
        state = self.block_metrics.pop(block.block_id, None)
        if state is not None:
            self._eviction_events.append(state.eviction_event(self.clock()))

    def reset(self) -> None:
        """The prefix cache was reset: forget every tracked block and pending event."""
        self.block_metrics.clear()
        self._eviction_events.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        """The events since the previous call."""
        events, self._eviction_events = self._eviction_events, []
        return events
