"""The bookkeeping of the host-memory KV tier: which tier block holds which block hash.

The tier's blocks are indexed by the same chained block hashes as the prefix cache
(``kv_cache_utils.hash_block_tokens``), so a hash found here means the whole prefix up to
that block is here too, provided the blocks before it are. No data lives here: the
runner's ``CPUOffloadingHandler`` holds the tensors, and the ids below index them.

Each block is in exactly one state::

    free      no hash, ref_cnt 0       in ``_free_ids``
    cached    a hash,  ref_cnt 0       in ``_lru`` (oldest first: evicted first)
    loading   a hash,  ref_cnt > 0     a load of this step reads it: not evictable
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import MEDIUM_CPU
from vllm.v1.core.kv_cache_utils import BlockHash, first_group_key

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVEventLog


class CPUBlockPool:
    """Tier blocks by hash, LRU-evicted; blocks read by a planned load are held.

    Invariants (``check_invariants``): free + cached + loading == ``num_blocks``; a hash
    maps to exactly one block and back; ``ref_cnt == 0`` iff the block is not loading.
    """

    def __init__(self, num_blocks: int, kv_events: KVEventLog | None = None) -> None:
        """``kv_events``: where to record each hash the tier starts or stops holding
        (medium ``"CPU"``; the tier knows a block's hash, not its tokens), the first KV
        cache group's only (the hybrid KV cache keys the others ``(group, hash)``)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.kv_events = kv_events
        self._free_ids: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._hash_to_id: dict[BlockHash, int] = {}
        self._id_to_hash: dict[int, BlockHash] = {}
        self._ref_cnt: dict[int, int] = {}  # only blocks with ref_cnt > 0
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()

    # -- lookups ------------------------------------------------------------------------
    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hash_to_id

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds (no side effect)."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self._hash_to_id:
                break
            n += 1
        return n

    def lru_hashes(self) -> list[BlockHash]:
        """The evictable hashes, next to be evicted first."""
        return list(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_ids)

    @property
    def num_held_blocks(self) -> int:
        return len(self._ref_cnt)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # -- loads --------------------------------------------------------------------------
    def acquire(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Hold the blocks of these (present) hashes for a load: they leave the LRU, so no
        store can evict them until ``release``. Returns their ids, in order."""
        ids = []
        for block_hash in block_hashes:
            block_id = self._hash_to_id[block_hash]
            self._lru.pop(block_hash, None)
            self._ref_cnt[block_id] = self._ref_cnt.get(block_id, 0) + 1
            ids.append(block_id)
        return ids

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one hold each; a block no longer held rejoins the LRU as most recent."""
        for block_id in block_ids:
            n = self._ref_cnt[block_id] - 1
            if n:
                self._ref_cnt[block_id] = n
                continue
            del self._ref_cnt[block_id]
            self._lru[self._id_to_hash[block_id]] = block_id

    # -- stores -------------------------------------------------------------------------
    def touch(self, block_hash: BlockHash) -> None:
        """A present hash was used again: it becomes the most recent (if evictable)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)

    def allocate(self, block_hash: BlockHash) -> int | None:
        """A block to store ``block_hash`` (not present) in: a free one, else the least
        recently used cached one (its hash is dropped). None if every block is held."""
        if block_hash in self._hash_to_id:
            raise ValueError("the tier already holds this hash")
        if self._free_ids:
            block_id = self._free_ids.pop()
        elif self._lru:
            old_hash, block_id = self._lru.popitem(last=False)
            del self._hash_to_id[old_hash]
            if self.kv_events is not None and first_group_key(old_hash):
                self.kv_events.removed(old_hash, MEDIUM_CPU)
        else:
            return None
        self._hash_to_id[block_hash] = block_id
        self._id_to_hash[block_id] = block_hash
        self._lru[block_hash] = block_id
        if self.kv_events is not None and first_group_key(block_hash):
            self.kv_events.stored([block_hash], None, [], 0, MEDIUM_CPU)  # vLLM's placeholder
        return block_id

    def discard(self, block_ids: Sequence[int]) -> None:
        """Forget the hashes of these blocks (not held), which become free: the copy that
        was to fill them never ran. Blocks without a hash are skipped."""
        for block_id in block_ids:
            if block_id in self._ref_cnt:
                raise ValueError(f"tier block {block_id} is held by a load")
            block_hash = self._id_to_hash.pop(block_id, None)
            if block_hash is None:
                continue
            del self._hash_to_id[block_hash]
            self._lru.pop(block_hash, None)
            self._free_ids.append(block_id)
            if self.kv_events is not None and first_group_key(block_hash):
                self.kv_events.removed(block_hash, MEDIUM_CPU)

    def reset(self) -> bool:
        """Forget every hash; refused (False) while a load holds a block."""
        if self._ref_cnt:
            return False
        self.__init__(self.num_blocks, self.kv_events)  # type: ignore[misc]
        return True

    def check_invariants(self) -> None:
        free = set(self._free_ids)
        assert len(free) == len(self._free_ids), "duplicate free tier block"
        assert len(self._hash_to_id) == len(self._id_to_hash), "hash map not a bijection"
        for block_hash, block_id in self._hash_to_id.items():
            assert self._id_to_hash[block_id] == block_hash, "hash map not a bijection"
            assert block_id not in free, f"tier block {block_id} is free and holds a hash"
            held = block_id in self._ref_cnt
            assert held != (block_hash in self._lru), f"tier block {block_id}: held and in LRU"
        for block_hash, block_id in self._lru.items():
            assert self._hash_to_id.get(block_hash) == block_id, "stale LRU entry"
        assert all(n > 0 for n in self._ref_cnt.values()), "non-positive hold count"
        assert len(free) + len(self._hash_to_id) == self.num_blocks, "tier blocks leaked"
