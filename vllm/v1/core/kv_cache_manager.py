"""Per-request view of the block pool: prefix lookup, slot allocation, freeing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock, cdiv, group_key, kv_capacity_tokens
from vllm.v1.core.sched.output import KVOffloadTransfers
from vllm.v1.kv_offload.manager import OffloadManager
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVEventLog
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

# A request's blocks, one list per KV cache group (vLLM's tuple of per-group block lists).
GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheManager:
    """Owns which blocks each request holds. The scheduler is its only caller.

    A request keeps its blocks until ``free`` is called, so a finished request that the
    policy pins simply is not freed yet: its blocks keep their references.

    **KV cache groups** (``kv_cache_windows``, one entry a group: None for full
    attention, else the group's sliding window). A model whose layers all attend to the
    whole context has one group; a hybrid model (gpt-oss, Gemma 2/3, Cohere 2: some
    layers slide over a window) has a group per kind of layer, all drawing blocks from
    the one pool (the runner lays each group's layers over the same tensors, vLLM's
    hybrid KV cache manager). A request holds a list of blocks per group, aligned by
    position; a sliding group frees the blocks its window has passed (they become the
    null block in the list and keep their hash, evictable) before each allocation, so it
    holds about ``window + chunk`` tokens of blocks however long the context. A prefix
    hit must hold in every group: the full groups' leading blocks, and in each sliding
    group the ``window - 1`` positions before the hit's end.

    With ``num_cpu_blocks`` (and prefix caching) a second tier in host memory backs the
    pool: a hashed block is saved there when it is evicted for reuse or freed with
    ``offload=True``, and a prefix that misses the pool but hits the tier is loaded back
    into newly allocated blocks (``num_external_computed_tokens``). The copies are planned
    here and run by the runner (``take_kv_transfers``). With several groups the tier
    holds each group's blocks under its own key (a tier block is a KV cache block's
    bytes, whichever group's), and a tier hit holds in every group as a prefix hit does:
    the full groups' blocks, and the sliding groups' blocks of the window before its end.
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
        kv_cache_windows: tuple[int | None, ...] = (None,),
        max_num_batched_tokens: int | None = None,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        """``kv_events``: the log both pools record their held hashes' changes into
        (--kv-events-config). ``kv_cache_windows``: the KV cache groups (above).
        ``max_num_batched_tokens``: the most tokens one step computes (a sliding group's
        peak holding; None: a whole sequence in one step). ``metrics_collector``: the
        pool's (--kv-cache-metrics; None: off)."""
        windows = tuple(kv_cache_windows)
        if not windows:
            raise ValueError("kv_cache_windows must name at least one KV cache group")
        for w in windows:
            if w is not None and (not isinstance(w, int) or w < 1):
                raise ValueError(f"kv_cache_windows: a window must be an int >= 1, got {w!r}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.windows = windows
        self.num_groups = len(windows)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching, kv_events, metrics_collector)
        self.req_to_blocks: dict[str, GroupBlocks] = {}
        # Blocks of each request that already carry their hash (the same in every group).
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Without prefix caching no block has a hash, so the tier could hold nothing.
        self.offload: OffloadManager | None = None
        if num_cpu_blocks > 0 and enable_caching:
            self.offload = OffloadManager(num_cpu_blocks, cpu_block_bytes, kv_events)
            self.block_pool.on_evict = self.offload.save

    def _num_skipped_blocks(self, group: int, num_computed_tokens: int) -> int:
        """Leading blocks of ``group`` that no token from ``num_computed_tokens`` on
        attends to (0 for full attention): those before the next token's window."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed_tokens - window + 1) // self.block_size

    # -- lookups ------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """Longest run of cached full blocks prefixing the request in every group, and
        its length in tokens; does not touch them. A sliding group's list holds the null
        block where its window does not reach.

        Never the whole prompt: the last token is always computed, to get its logits.
        Records no stats: a waiting request is looked up again every step until it fits,
        so the scheduler counts the lookup once, at admission (``record_prefix_cache_query``).
        Nothing for a request that must compute its prompt (``skip_reading_prefix_cache``:
        prompt logprobs).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return tuple([] for _ in self.windows), 0
        length = (request.num_tokens - 1) // self.block_size  # in blocks
        hashes = request.block_hashes
        hits: list[list[KVCacheBlock]] = [[] for _ in self.windows]
        sliding = []
        for g, window in enumerate(self.windows):
            if window is not None:
                sliding.append(g)
                continue
            blocks = hits[g] = self._full_hit(g, hashes, length)
            length = len(blocks)
        # A sliding group's hit at a shorter length is not a prefix of its longer one:
        # search again until every group agrees (lengths only shrink).
        settled = not sliding
        while not settled:
            settled = True
            for g in sliding:
                hits[g] = self._sliding_hit(g, hashes, length)
                if len(hits[g]) < length:
                    length, settled = len(hits[g]), False
        return tuple(h[:length] for h in hits), length * self.block_size

    def _full_hit(self, group: int, hashes: list, max_blocks: int) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        pool = self.block_pool
        for block_hash in hashes[:max_blocks]:
            block = pool.get_cached_block(block_hash, group)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _sliding_hit(self, group: int, hashes: list, max_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_blocks`` blocks for a sliding group: its last
        ``cdiv(window - 1, block_size)`` blocks cached (the window of the first token
        after it), or a run from the start; the null block before them (vLLM's
        right-to-left search)."""
        window = self.windows[group]
        assert window is not None
        need = cdiv(window - 1, self.block_size)
        pool = self.block_pool
        null = pool.null_block
        if need == 0:
            return [null] * max_blocks
        run: list[KVCacheBlock] = []  # cached blocks, right to left
        for i in range(max_blocks - 1, -1, -1):
            block = pool.get_cached_block(hashes[i], group)
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == need:
                return [null] * i + run[::-1]
        return run[::-1]  # a run that reaches the first block: all of it is a hit

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
        hashes = request.block_hashes
        sliding = []
        for g, window in enumerate(self.windows):
            if window is not None:
                sliding.append(g)
            elif end > start:
                keys = [group_key(h, g) for h in hashes[start:end]]
                end = start + self.offload.lookup(keys)
        settled = not sliding
        while not settled:  # lengths only shrink, as in get_computed_blocks
            settled = True
            for g in sliding:
                group_end = self._sliding_tier_end(g, hashes, start, end)
                if group_end < end:
                    end, settled = group_end, False
        return (end - start) * bs

    def _sliding_tier_end(self, group: int, hashes: list, start: int, end: int) -> int:
        """The furthest block end at most ``end`` whose window the tier holds in sliding
        ``group`` from block ``start`` on (the blocks before ``start`` come from the pool's
        hit, which holds the window before ``start``)."""
        window = self.windows[group]
        assert window is not None and self.offload is not None
        need = cdiv(window - 1, self.block_size)
        if need == 0:
            return end
        run = 0
        for i in range(end - 1, start - 1, -1):
            if self.offload.lookup([group_key(hashes[i], group)]):
                run += 1
                if run == need:
                    return i + need
            else:
                run = 0
        return start + run  # a run from the hit's end: every block after it is loaded

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

    def token_capacity(self, num_blocks: int | None = None) -> int:
        """The longest sequence ``num_blocks`` usable blocks hold over every group (the
        whole pool by default; for one full-attention group, blocks x block size)."""
        if num_blocks is None:
            num_blocks = self.block_pool.num_gpu_blocks - 1
        return kv_capacity_tokens(
            num_blocks, self.block_size, self.windows, self.max_num_batched_tokens
        )

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` fits the pool at all."""
        return num_tokens <= self.token_capacity()

    @property
    def free_tokens(self) -> int:
        """Tokens of a new sequence the free (and evictable) blocks hold."""
        return self.token_capacity(self.block_pool.get_num_free_blocks())

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` (a prefix hit from ``get_computed_blocks``) are touched
        and appended first. ``num_external_computed_tokens`` (a new request's hit in the
        CPU tier, from ``get_num_offloaded_tokens``) follow: blocks are allocated for them
        and their loads planned, so they count as computed. A sliding group first frees
        the blocks its window has passed. Returns the ids of the newly allocated blocks,
        per group, or None (with nothing else changed) when the pool is short.
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
        has_hits = new_computed_blocks is not None and any(new_computed_blocks)
        if req_blocks is None or has_hits or num_external:
            new_ids = self._allocate_with_hits(
                request, req_blocks, total, num_computed, new_computed_blocks, num_external
            )
            if new_ids is None:
                return None
            req_blocks = self.req_to_blocks[req_id]
        else:
            # The decode fast path: a running request, usually no new block this step.
            if self.num_groups > 1 or self.windows[0] is not None:
                self._free_skipped(req_blocks, num_computed)
            num_needed = cdiv(total, bs)
            num_new = [max(num_needed - len(blocks), 0) for blocks in req_blocks]
            new_ids = tuple([] for _ in req_blocks)
            if any(num_new):
                if sum(num_new) > self.block_pool.free_block_queue.num_free_blocks:
                    return None
                for blocks, ids, n in zip(req_blocks, new_ids, num_new, strict=True):
                    if n:
                        new_blocks = self.block_pool.get_new_blocks(n)
                        blocks.extend(new_blocks)
                        ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            # Cache only blocks whose every token has KV after this step; block_hashes
            # covers exactly the full blocks of the known tokens, so it bounds the rest.
            num_full = (num_computed + num_new_tokens) // bs
            num_hashes = len(request.block_hashes)
            if num_full > num_hashes:
                num_full = num_hashes
            num_cached = self._num_cached_blocks.get(req_id, 0)
            if num_full > num_cached:
                for g, blocks in enumerate(req_blocks):
                    self.block_pool.cache_full_blocks(
                        request, blocks, num_cached, num_full, bs, group=g
                    )
                self._num_cached_blocks[req_id] = num_full
        return new_ids

    def _free_skipped(self, req_blocks: GroupBlocks, num_computed: int) -> None:
        """Free each sliding group's blocks before the window of the token after
        ``num_computed`` (they keep their hash: evictable, a later prefix may hit them),
        in their places the null block; newest first, as ``free`` frees a request's tail
        first (the free queue evicts in that order)."""
        null = self.block_pool.null_block
        for g, blocks in enumerate(req_blocks):
            skip = min(self._num_skipped_blocks(g, num_computed), len(blocks))
            freed = []
            for i in range(skip - 1, -1, -1):
                if blocks[i].is_null:
                    break  # freed by an earlier step, and all before it
                freed.append(blocks[i])
                blocks[i] = null
            if freed:
                self.block_pool.free_blocks(freed)

    def _allocate_with_hits(
        self,
        request: Request,
        req_blocks: GroupBlocks | None,
        total: int,
        num_computed: int,
        new_computed_blocks: GroupBlocks | None,
        num_external: int,
    ) -> tuple[list[int], ...] | None:
        """The general path: a new request and/or prefix-hit blocks to take over. A
        sliding group's hit blocks before its window stay unreferenced (the null block
        takes their place)."""
        bs = self.block_size
        pool = self.block_pool
        null = pool.null_block
        groups = range(self.num_groups)
        hits = new_computed_blocks or tuple([] for _ in groups)
        held = req_blocks if req_blocks is not None else tuple([] for _ in groups)
        taken: list[list[KVCacheBlock]] = []  # per group: hits to reference, null before
        num_new: list[int] = []
        num_revived = 0
        for g in groups:
            skip = self._num_skipped_blocks(g, num_computed)
            group_hits = list(hits[g])
            for i in range(max(0, min(skip - len(held[g]), len(group_hits)))):
                group_hits[i] = null
            # The tier's tokens may take a sliding group's window past the pool's hit:
            # the places between them and the window's start hold nothing.
            group_hits += [null] * max(0, skip - len(held[g]) - len(group_hits))
            taken.append(group_hits)
            num_new.append(max(cdiv(total, bs) - len(held[g]) - len(group_hits), 0))
            # The pitfall: a hit block with ref_cnt 0 sits in the free queue, so touching
            # it takes a free block just as allocating one does.
            num_revived += sum(1 for b in group_hits if b.ref_cnt == 0 and not b.is_null)
        if sum(num_new) + num_revived > pool.get_num_free_blocks():
            return None  # nothing was changed
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = tuple([] for _ in groups)
        cpu_ids: list[list[int]] = [[] for _ in groups]
        if num_external:
            # Held before allocating: the saves this allocation's evictions trigger must
            # not evict the tier blocks about to be loaded. Each group loads the blocks
            # after its places so far (a sliding group: its window's only).
            assert self.offload is not None and num_external % bs == 0
            end = num_computed // bs
            for g in groups:
                start = len(held[g]) + len(taken[g])
                keys = [group_key(h, g) for h in request.block_hashes[start:end]]
                cpu_ids[g] = self.offload.acquire(keys)
        for g in groups:  # every group's hits first: one group's new blocks must not be
            pool.touch(taken[g])  # popped from another's hits still in the free queue
            req_blocks[g].extend(taken[g])
        new_ids: tuple[list[int], ...] = tuple([] for _ in groups)
        for g in groups:
            if num_new[g] > 0:
                new_blocks = pool.get_new_blocks(num_new[g])
                req_blocks[g].extend(new_blocks)
                new_ids[g].extend(b.block_id for b in new_blocks)
            if cpu_ids[g]:
                self.offload.plan_loads(cpu_ids[g], new_ids[g][: len(cpu_ids[g])])
        return new_ids

    def free(self, request: Request, offload: bool = False) -> None:
        """Release the request's blocks, tail first (the tail is evicted first).

        Unknown ids are a no-op. Blocks shared with another request (a prefix hit) only
        lose this request's reference and stay in use. ``offload``: copy its hashed blocks
        to the CPU tier first (a policy's ``Offload``; the same as a plain free without a
        tier). Blocks hashed for tokens the request has not computed (it was scheduled and
        preempted in the same step) lose their hash: their data is not what it names.
        """
        groups = self.req_to_blocks.pop(request.request_id, None)
        num_cached = self._num_cached_blocks.pop(request.request_id, 0)
        if not groups:
            return
        first_uncomputed = request.num_computed_tokens // self.block_size
        for blocks in groups:
            for block in blocks[first_uncomputed:num_cached]:
                if block.block_hash is not None:
                    self.block_pool.uncache(block)
        if offload and self.offload is not None:
            for blocks in groups:
                for block in blocks:
                    if block.block_hash is not None:
                        self.offload.save(block)
        for blocks in reversed(groups):
            self.block_pool.free_blocks(reversed(blocks))

    # -- views ----------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (0: the null block)."""
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return tuple([] for _ in self.windows)
        return tuple([b.block_id for b in blocks] for blocks in groups)

    def get_num_blocks(self, request_id: str) -> int:
        """The blocks the request holds over every group (the null block not counted)."""
        groups = self.req_to_blocks.get(request_id, ())
        return sum(sum(1 for b in blocks if not b.is_null) for blocks in groups)

    def get_num_slots(self, request_id: str) -> int:
        """Token positions the request's block table covers (in every group)."""
        groups = self.req_to_blocks.get(request_id)
        return len(groups[0]) * self.block_size if groups else 0

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
        for req_id, groups in self.req_to_blocks.items():
            assert len(groups) == self.num_groups, f"{req_id}: {len(groups)} groups"
            assert len({len(b) for b in groups}) == 1, f"{req_id}: groups of unequal length"
            for blocks in groups:
                for block in blocks:
                    if block.is_null:
                        continue
                    assert block.ref_cnt >= 1, f"{req_id} holds a free block {block}"
                    holders[block.block_id] = holders.get(block.block_id, 0) + 1
        # Every reference is held by exactly one request entry (pins keep their entry).
        for block in self.block_pool.blocks[1:]:
            n = holders.get(block.block_id, 0)
            assert n == block.ref_cnt, f"{block}: {n} holders != ref_cnt {block.ref_cnt}"
