"""The pool of KV blocks: allocation, reference counts, prefix-cache map, LRU eviction."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_GPU
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    first_group_key,
    group_key,
)

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVEventLog
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector
    from vllm.v1.request import Request


class BlockHashToBlockMap:
    """block hash -> {block_id: block}. Several blocks may hold the same hash (v1's block
    tables are append-only, so a duplicate computed concurrently is kept, not merged)."""

    def __init__(self) -> None:
        self._map: dict[BlockHash, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        blocks = self._map.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        self._map.setdefault(block_hash, {})[block.block_id] = block

    def pop(self, block_hash: BlockHash, block_id: int) -> KVCacheBlock | None:
        blocks = self._map.get(block_hash)
        if not blocks:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._map[block_hash]
        return block

    def __len__(self) -> int:
        return sum(len(b) for b in self._map.values())

    def clear(self) -> None:
        self._map.clear()

    def contains(self, block: KVCacheBlock) -> bool:
        return block.block_hash is not None and block.block_id in self._map.get(
            block.block_hash, {}
        )


class BlockPool:
    """All KV blocks of one cache. Block 0 is the null block: never allocated or freed.

    Invariants (``check_invariants``): ``ref_cnt == 0`` iff the block is in the free
    queue; a block holding a hash is in the hash map; free + used + 1 (null) == total.
    A free block may still hold a hash ("cached"): it is evicted lazily when popped.
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        kv_events: KVEventLog | None = None,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        """``kv_events``: where to record each hash this pool starts or stops holding
        (--kv-events-config); None records nothing. ``metrics_collector``
        (--kv-cache-metrics): told of each block allocated, hit and evicted; None: off."""
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.num_cached_blocks = 0  # blocks currently holding a hash
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Called with a cached block just before its hash is evicted for reuse (its data is
        # still intact): the CPU tier copies it there.
        self.on_evict: Callable[[KVCacheBlock], None] | None = None
        self.kv_events = kv_events
        self.metrics_collector = metrics_collector

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        """A block holding ``block_hash`` for KV cache group ``group`` (the hybrid KV
        cache: each group's layers live in blocks of their own), or None."""
        return self.cached_block_hash_to_block.get_one_block(group_key(block_hash, group))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head of the free queue (evicting their hashes).

        Each returned block has ``ref_cnt == 1``. ValueError (nothing changed) if short.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: {self.get_num_free_blocks()} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self.metrics_collector is not None:
            self._record_reuse(blocks)
        for block in blocks:
            self._evict_hash(block)
            block.ref_cnt = 1
        return blocks

    def _record_reuse(self, blocks: list[KVCacheBlock]) -> None:
        """--kv-cache-metrics: a block taken for new data ends its cached life (an eviction,
        when it held a prefix hash, as vLLM counts them) and begins a new one."""
        collector = self.metrics_collector
        for block in blocks:
            if block.block_hash is not None:
                collector.on_block_evicted(block)
            collector.on_block_allocated(block)

    def _evict_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.on_evict is not None:
            self.on_evict(block)
        self.uncache(block)

    def uncache(self, block: KVCacheBlock) -> None:
        """Drop ``block``'s hash (it must hold one): its data is no longer what it names."""
        block_hash = block.block_hash
        assert block_hash is not None
        self.cached_block_hash_to_block.pop(block_hash, block.block_id)
        block.reset_hash()
        self.num_cached_blocks -= 1
        if (
            self.kv_events is not None
            and first_group_key(block_hash)  # events speak of the first group only
            and self.get_cached_block(block_hash) is None
        ):
            self.kv_events.removed(block_hash, MEDIUM_GPU)  # no block holds it any more

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference; a free (cached) block leaves the free queue.

        This is how a prefix hit revives a cached block, so the caller must count blocks
        with ``ref_cnt == 0`` among ``blocks`` against the free blocks. The null block is
        skipped, as in ``free_blocks``.
        """
        collector = self.metrics_collector
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if collector is not None:
                collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue's tail in order."""
        for block in ordered_blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int | None = None,
        group: int = 0,
    ) -> None:
        """Give ``blocks[num_cached_blocks:num_full_blocks]`` their hashes.

        The hashes are ``request.block_hashes[i]`` (the request's hasher fixes the block
        size, so ``block_size`` is accepted for vLLM's signature but not needed), keyed by
        KV cache ``group`` (``group_key``; KV events record the first group's). A block
        that already holds a hash (a prefix hit) and the null block (a sliding window's
        freed place) are skipped; a block whose hash another block already holds is still
        inserted (both stay in the map).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full_blocks:
            raise ValueError(f"{request.request_id}: {len(hashes)} hashes < {num_full_blocks}")
        events = self.kv_events if group == 0 else None
        run_start = None  # the first block of a run of hashes new to the pool (events)
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                new = False  # already cached (a prefix hit)
            else:
                key = group_key(hashes[i], group)
                new = events is not None and self.get_cached_block(hashes[i]) is None
                block.block_hash = key
                self.cached_block_hash_to_block.insert(key, block)
                self.num_cached_blocks += 1
            if new and run_start is None:
                run_start = i
            elif not new and run_start is not None:
                self._record_stored(request, run_start, i, block_size)
                run_start = None
        if run_start is not None:
            self._record_stored(request, run_start, num_full_blocks, block_size)

    def _record_stored(self, request: Request, start: int, end: int, block_size: int | None):
        """One ``BlockStored`` for the request's blocks ``start:end``, hashes new to the
        pool: their tokens, and the hash of the block before them as the parent."""
        if block_size is None:
            raise ValueError("KV cache events need cache_full_blocks' block_size")
        hashes = request.block_hashes
        lora = request.lora_request
        extra_keys = None
        if start == 0 and (lora is not None or request.cache_salt is not None):
            # What entered the first block's hash besides its tokens (kv_cache_utils).
            names = (None if lora is None else lora.lora_name, request.cache_salt)
            first = tuple(k for k in names if k is not None)
            extra_keys = [first] + [None] * (end - start - 1)
        self.kv_events.stored(
            hashes[start:end],
            hashes[start - 1] if start else None,
            request.all_token_ids[start * block_size : end * block_size],
            block_size,
            MEDIUM_GPU,
            lora,
            extra_keys,
            request.job_id,
        )

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_gpu_blocks - 1:
            return False
        for block in self.blocks:
            block.reset_hash()
        self.cached_block_hash_to_block.clear()
        self.num_cached_blocks = 0
        if self.kv_events is not None:
            self.kv_events.cleared()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        return True

    def check_invariants(self) -> None:
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "duplicate block in the free queue"
        assert len(free) == self.free_block_queue.num_free_blocks, "free count drifted"
        assert self.null_block.block_id not in free_ids, "null block in the free queue"
        hashed = 0
        for block in self.blocks[1:]:
            in_free = block.block_id in free_ids
            assert (block.ref_cnt == 0) == in_free, f"{block}: ref_cnt/free-queue mismatch"
            assert block.ref_cnt >= 0, f"{block}: negative ref_cnt"
            if block.block_hash is not None:
                hashed += 1
                assert self.cached_block_hash_to_block.contains(block), f"{block} not in map"
        assert hashed == self.num_cached_blocks == len(self.cached_block_hash_to_block)
        used = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert len(free) + used + 1 == self.num_gpu_blocks, "blocks leaked"
