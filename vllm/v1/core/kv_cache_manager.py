"""Per-request view of the block pool: prefix lookup, slot allocation, freeing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import KVOffloadTransfers
from vllm.v1.kv_offload.manager import OffloadManager
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVEventLog


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns which blocks each request holds. The scheduler is its only caller.

    A request keeps its blocks until ``free`` is called, so a finished request that the
    policy pins simply is not freed yet: its blocks keep their references.

    With ``num_cpu_blocks`` (and prefix caching) a second tier in host memory backs the
    pool: a hashed block is saved there when it is evicted for reuse or freed with
    ``offload=True``, and a prefix that misses the pool but hits the tier is loaded back
    into newly allocated blocks (``num_external_computed_tokens``). The copies are planned
    here and run by the runner (``take_kv_transfers``).
    """

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        num_cpu_blocks: int = 0,
        cpu_block_bytes: int = 0,
        kv_events: KVEventLog | None = None,
    ) -> None:
        """``kv_events``: the log both pools record their held hashes' changes into
        (--kv-events-config)."""
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, kv_events)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Blocks of each request that already carry their hash.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Without prefix caching no block has a hash, so the tier could hold nothing.
        self.offload: OffloadManager | None = None
        if num_cpu_blocks > 0 and enable_caching:
            self.offload = OffloadManager(num_cpu_blocks, cpu_block_bytes, kv_events)
            self.block_pool.on_evict = self.offload.save

    # -- lookups ------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks prefixing the request; does not touch them.

        Never the whole prompt: the last token is always computed, to get its logits.
        Records no stats: a waiting request is looked up again every step until it fits,
        so the scheduler counts the lookup once, at admission (``record_prefix_cache_query``).
        Nothing for a request that must compute its prompt (``skip_reading_prefix_cache``:
        prompt logprobs).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def get_num_offloaded_tokens(
        self, request: Request, num_computed_tokens: int, max_tokens: int | None = None
    ) -> int:
        """Tokens after the pool's hit (``num_computed_tokens``) that the CPU tier holds:
        whole blocks, at most ``max_tokens``, never reaching the prompt's last token.
        No side effect (``allocate_slots`` takes them)."""
        if self.offload is None or request.skip_reading_prefix_cache:
            return 0
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs
        if max_tokens is not None:
            end = min(end, start + max_tokens // bs)
        return self.offload.lookup(request.block_hashes[start:end]) * bs

    def record_prefix_cache_query(
        self, num_tokens: int, num_hit_tokens: int, num_external_hit_tokens: int = 0
    ) -> None:
        """Count one admitted request's lookup (not every retry of a waiting request), and
        its lookup in the CPU tier when there is one."""
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += num_tokens
        stats.hits += num_hit_tokens
        if self.offload is not None:
            self.offload.record_query(num_tokens, num_external_hit_tokens)

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits the pool at all."""
        return cdiv(num_tokens, self.block_size) <= self.block_pool.num_gpu_blocks - 1

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` (a prefix hit from ``get_computed_blocks``) are touched
        and appended first. ``num_external_computed_tokens`` (a new request's hit in the
        CPU tier, from ``get_num_offloaded_tokens``) follow: blocks are allocated for them
        and their loads planned, so they count as computed. Returns the ids of the newly
        allocated blocks, or None (with nothing changed) when the pool is short.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        req_id = request.request_id
        bs = self.block_size
        num_external = num_external_computed_tokens
        num_computed = request.num_computed_tokens + num_new_computed_tokens + num_external
        total = num_computed + num_new_tokens + num_lookahead_tokens
        if total > self.max_model_len:
            total = self.max_model_len
        req_blocks = self.req_to_blocks.get(req_id)
        if req_blocks is None or new_computed_blocks or num_external:
            new_ids = self._allocate_with_hits(
                request, req_blocks, total, new_computed_blocks, num_external
            )
            if new_ids is None:
                return None
            req_blocks = self.req_to_blocks[req_id]
        else:
            # The decode fast path: a running request, usually no new block this step.
            num_new_blocks = (total + bs - 1) // bs - len(req_blocks)
            new_ids = []
            if num_new_blocks > 0:
                if num_new_blocks > self.block_pool.free_block_queue.num_free_blocks:
                    return None
                new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
                req_blocks.extend(new_blocks)
                new_ids = [b.block_id for b in new_blocks]
        if self.enable_caching:
            # Cache only blocks whose every token has KV after this step; block_hashes
            # covers exactly the full blocks of the known tokens, so it bounds the rest.
            num_full = (num_computed + num_new_tokens) // bs
            num_hashes = len(request.block_hashes)
            if num_full > num_hashes:
                num_full = num_hashes
            num_cached = self._num_cached_blocks.get(req_id, 0)
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(request, req_blocks, num_cached, num_full, bs)
                self._num_cached_blocks[req_id] = num_full
        return new_ids

    def _allocate_with_hits(
        self,
        request: Request,
        req_blocks: list[KVCacheBlock] | None,
        total: int,
        new_computed_blocks: list[KVCacheBlock] | None,
        num_external: int,
    ) -> list[int] | None:
        """The general path: a new request and/or prefix-hit blocks to take over."""
        hits = new_computed_blocks or []
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_new_blocks = cdiv(total, self.block_size) - num_held - len(hits)
        # The pitfall: a hit block with ref_cnt 0 sits in the free queue, so touching it
        # takes a free block just as allocating one does.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
        pool = self.block_pool
        if max(num_new_blocks, 0) + num_revived > pool.get_num_free_blocks():
            return None  # nothing was changed
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        cpu_ids = []
        if num_external:
            # Held before allocating: the saves this allocation's evictions trigger must
            # not evict the tier blocks about to be loaded.
            assert self.offload is not None and num_external % self.block_size == 0
            start = len(req_blocks) + len(hits)
            hashes = request.block_hashes[start : start + num_external // self.block_size]
            cpu_ids = self.offload.acquire(hashes)
        pool.touch(hits)
        req_blocks.extend(hits)
        if num_new_blocks <= 0:
            return []
        new_blocks = pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        new_ids = [b.block_id for b in new_blocks]
        if cpu_ids:
            self.offload.plan_loads(cpu_ids, new_ids[: len(cpu_ids)])
        return new_ids

    def free(self, request: Request, offload: bool = False) -> None:
        """Release the request's blocks, tail first (the tail is evicted first).

        Unknown ids are a no-op. Blocks shared with another request (a prefix hit) only
        lose this request's reference and stay in use. ``offload``: copy its hashed blocks
        to the CPU tier first (a policy's ``Offload``; the same as a plain free without a
        tier). Blocks hashed for tokens the request has not computed (it was scheduled and
        preempted in the same step) lose their hash: their data is not what it names.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        num_cached = self._num_cached_blocks.pop(request.request_id, 0)
        if not blocks:
            return
        for block in blocks[request.num_computed_tokens // self.block_size : num_cached]:
            if block.block_hash is not None:
                self.block_pool.uncache(block)
        if offload and self.offload is not None:
            for block in blocks:
                if block.block_hash is not None:
                    self.offload.save(block)
        self.block_pool.free_blocks(reversed(blocks))

    # -- views ----------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, []))

    @property
    def num_requests(self) -> int:
        return len(self.req_to_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The counts since the previous call."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_kv_transfers(self) -> KVOffloadTransfers | None:
        """The copies planned since the last call, for this step's ``SchedulerOutput``."""
        return self.offload.take_transfers() if self.offload is not None else None

    def discard_kv_saves(self, transfers: KVOffloadTransfers) -> None:
        """A step failed before (or while) running ``transfers``: the CPU tier forgets the
        blocks its saves were to fill. (Its loads went into blocks of the step's requests,
        which fail and lose their hashes.)"""
        if self.offload is not None:
            self.offload.discard_saves(transfers)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, in the KV cache and the tier, or (False) change nothing."""
        if self.offload is not None and not self.offload.can_reset():
            return False
        ok = self.block_pool.reset_prefix_cache()  # records AllBlocksCleared: both media
        if ok and self.offload is not None:
            ok = self.offload.reset()
            assert ok, "the tier refused a reset it allowed"
        if ok:
            self.prefix_cache_stats.reset = True
        return ok

    def check_invariants(self) -> None:
        self.block_pool.check_invariants()
        if self.offload is not None:
            self.offload.check_invariants()
        holders: dict[int, int] = {}
        for req_id, blocks in self.req_to_blocks.items():
            for block in blocks:
                assert block.ref_cnt >= 1, f"{req_id} holds a free block {block}"
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        # Every reference is held by exactly one request entry (pins keep their entry).
        for block in self.block_pool.blocks[1:]:
            n = holders.get(block.block_id, 0)
            assert n == block.ref_cnt, f"{block}: {n} holders != ref_cnt {block.ref_cnt}"
