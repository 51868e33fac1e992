"""The scheduler's side of the CPU KV tier: what to save, what to load, and the plan.

The KV cache manager calls it at three points: a hashed block leaves the KV cache
(``save``: evicted for reuse, or freed by a policy's ``Offload``), a waiting request's
prefix misses the KV cache (``lookup``), and blocks are allocated for the tier's hit
(``acquire`` then ``plan_loads``). Copies are not run here: they accumulate into one
``KVOffloadTransfers`` that the scheduler hands to the runner with the step
(``take_transfers``), and the runner runs them before the step's forward pass.

Why that order is race-free: a saved KV cache block is unchanged since the previous
step ended (saves run before this step's loads and forward overwrite it); a loaded
block was allocated this step and is read only by this step's forward, after the load;
a tier block read by a load is held (not evictable) until the plan is taken, so no save
of the same step can overwrite it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock
from vllm.v1.core.sched.output import KVOffloadTransfers
from vllm.v1.kv_offload.cpu_pool import CPUBlockPool
from vllm.v1.metrics.stats import OffloadStats, PrefixCacheStats

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVEventLog


class OffloadManager:
    """Plans the copies between the KV cache and a ``CPUBlockPool`` of ``num_blocks``.

    Counters (``num_saved``, ``num_loaded`` blocks, ``external_stats``) are deltas since
    the last ``make_stats``. Between steps no tier block is held, except for a
    remote reader (``save_and_hold`` / ``store_and_hold``, disaggregated prefill).
    """

    def __init__(
        self, num_blocks: int, block_bytes: int = 0, kv_events: KVEventLog | None = None
    ) -> None:
        self.pool = CPUBlockPool(num_blocks, kv_events)
        self.block_bytes = block_bytes  # bytes of one block, for the bytes-moved metric
        self._transfers = KVOffloadTransfers()
        self._held: list[int] = []
        self.num_saved = 0
        self.num_loaded = 0
        self.external_stats = PrefixCacheStats()

    # -- saves --------------------------------------------------------------------------
    def save(self, block: KVCacheBlock) -> None:
        """Copy ``block`` (full, hashed, its data computed) to the tier unless it is there.

        Dropped silently when every tier block is held by this step's loads."""
        block_hash = block.block_hash
        assert block_hash is not None, "only hashed blocks can be offloaded"
        if block_hash in self.pool:
            self.pool.touch(block_hash)
            return
        cpu_id = self.pool.allocate(block_hash)
        if cpu_id is None:
            return
        self._transfers.saves.append((block.block_id, cpu_id))
        self.num_saved += 1

    # -- loads --------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``block_hashes`` the tier holds."""
        return self.pool.lookup(block_hashes)

    def acquire(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Hold the tier blocks of a hit (from ``lookup``) until the step's plan is taken,
        so that saves triggered by the same allocation cannot evict them."""
        ids = self.pool.acquire(block_hashes)
        self._held.extend(ids)
        return ids

    def plan_loads(self, cpu_ids: Sequence[int], gpu_block_ids: Sequence[int]) -> None:
        """Copy the acquired tier blocks into these newly allocated KV cache blocks."""
        self._transfers.loads.extend(zip(cpu_ids, gpu_block_ids, strict=True))
        self.num_loaded += len(cpu_ids)

    # -- holds for a remote reader (disaggregated prefill) -------------------------------
    def save_and_hold(self, block: KVCacheBlock) -> int | None:
        """Save ``block`` (unless the tier has its hash) and hold its tier block until
        ``unhold``: no store evicts it meanwhile. None when every tier block is held. The
        data is there once this step's plan has run."""
        self.save(block)
        if block.block_hash not in self.pool:
            return None
        return self.pool.acquire([block.block_hash])[0]

    def store_and_hold(self, block_hash: BlockHash) -> tuple[int, bool] | None:
        """A tier block for ``block_hash``, held until ``unhold``: (its id, whether the
        caller must fill it: False when the tier had the hash). None when every block is
        held."""
        fill = block_hash not in self.pool
        if fill and self.pool.allocate(block_hash) is None:
            return None
        return self.pool.acquire([block_hash])[0], fill

    def unhold(self, block_ids: Sequence[int]) -> None:
        self.pool.release(block_ids)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """An admitted request looked up ``num_tokens`` and loaded ``num_hit_tokens``."""
        self.external_stats.requests += 1
        self.external_stats.queries += num_tokens
        self.external_stats.hits += num_hit_tokens

    # -- the plan -----------------------------------------------------------------------
    def take_transfers(self) -> KVOffloadTransfers | None:
        """This step's copies (None if none); the tier blocks held for its loads are
        released: the runner runs these loads before any later step's saves."""
        transfers, self._transfers = self._transfers, KVOffloadTransfers()
        self.pool.release(self._held)
        self._held = []
        return transfers or None

    def discard_saves(self, transfers: KVOffloadTransfers) -> None:
        """The step that was to run ``transfers`` failed: its saves may not have run, so
        the tier blocks they were to fill are forgotten (a saved one is only a lost hit)."""
        self.pool.discard([cpu_id for _, cpu_id in transfers.saves])

    def make_stats(self) -> tuple[PrefixCacheStats, OffloadStats]:
        """The lookups and copies since the previous call, and the tier's usage."""
        copies = self.num_saved + self.num_loaded
        stats = OffloadStats(self.usage, self.num_saved, self.num_loaded, copies * self.block_bytes)
        external, self.external_stats = self.external_stats, PrefixCacheStats()
        self.num_saved = self.num_loaded = 0
        return external, stats

    def can_reset(self) -> bool:
        """No tier block is held: by a load of this step or for a remote reader (both are
        the pool's holds)."""
        return not self.pool.num_held_blocks

    def reset(self) -> bool:
        return self.can_reset() and self.pool.reset()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        for cpu_id in self._held:
            assert 0 <= cpu_id < self.pool.num_blocks, f"held tier block {cpu_id} out of range"
        for _, cpu_id in self._transfers.saves:
            assert 0 <= cpu_id < self.pool.num_blocks, f"save into tier block {cpu_id}"
