"""KV cache blocks, the free-block queue, and chained block hashing (vLLM v1 semantics)."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request

# A block's hash: sha256 digest (bytes) of (parent hash, block token ids, extra keys).
# sha256 over a pickle of plain tuples is deterministic across processes, unlike hash().
BlockHash = bytes
NONE_HASH: BlockHash = hashlib.sha256(b"vllm-continuum-root").digest()


def group_key(block_hash: BlockHash, group: int) -> BlockHash | tuple[int, BlockHash]:
    """The prefix-cache key of a block of KV cache group ``group``: the hash itself for
    the first group (so one group's keys, the KV events and the CPU tier are unchanged),
    ``(group, hash)`` for the others, whose blocks hold other layers' K/V."""
    return block_hash if group == 0 else (group, block_hash)


def first_group_key(key: BlockHash | tuple[int, BlockHash]) -> bool:
    """Whether ``key`` (``group_key``'s) is the first group's: the keys KV events name."""
    return isinstance(key, bytes)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Chained hash: equal only if the whole prefix up to this block is equal.

    ``parent_hash`` None means the first block (chained from ``NONE_HASH``).
    """
    payload = (parent_hash or NONE_HASH, tuple(token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()


def _extra_keys(request: Request, block_index: int, block_size: int) -> tuple[Any, ...] | None:
    # The cache salt (which isolates tenants) and the LoRA adapter's name (one adapter's
    # KV is never another's, nor the base model's) enter the first block only: the
    # chaining carries them to every later block. An image's identifier enters each
    # block its placeholder tokens touch (the tokens alone are the same for every image).
    keys: tuple[Any, ...] = ()
    lora = request.lora_request
    if block_index == 0 and (request.cache_salt is not None or lora is not None):
        keys = (request.cache_salt, None if lora is None else lora.lora_name)
    if request.mm_features:
        start = block_index * block_size
        images = tuple(
            (f.identifier, f.offset - start)
            for f in request.mm_features
            if f.offset < start + block_size and f.end > start
        )
        if images:
            keys = (*keys, images)
    if request.prompt_embeds is not None and block_index * block_size < request.num_prompt_tokens:
        # The prompt's token ids are placeholders: its embeddings' bytes tell blocks apart,
        # so an embeds prompt never shares a block with a token prompt or another's embeds.
        keys = (*keys, ("prompt_embeds", _embeds_digest(request, block_index, block_size)))
    return keys or None


def _embeds_digest(request: Request, block_index: int, block_size: int) -> bytes:
    """sha256 of the prompt embeddings of one block's positions (as vLLM hashes them)."""
    import torch  # only a request with embeddings (a torch tensor) gets here

    block = request.prompt_embeds[block_index * block_size : (block_index + 1) * block_size]
    data = block.contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).digest()


def get_request_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """A function giving the hashes of a request's new full blocks (not yet hashed)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")

    def hasher(request: Request) -> list[BlockHash]:
        start = len(request.block_hashes)
        tokens = request.all_token_ids
        if len(tokens) // block_size <= start:
            return []  # the common decode step: no block filled up
        parent = request.block_hashes[-1] if start else None
        new: list[BlockHash] = []
        for i in range(start, len(tokens) // block_size):
            parent = hash_block_tokens(
                parent,
                tokens[i * block_size : (i + 1) * block_size],
                _extra_keys(request, i, block_size),
            )
            new.append(parent)
        return new

    return hasher


class KVCacheBlock:
    """Metadata of one KV block. ``ref_cnt`` counts the requests (and pins) using it."""

    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(
        self,
        block_id: int,
        ref_cnt: int = 0,
        block_hash: BlockHash | None = None,
        is_null: bool = False,
    ) -> None:
        self.block_id = block_id
        self.ref_cnt = ref_cnt
        self.block_hash = block_hash
        # Links of the free queue; both None iff the block is not in it.
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = is_null

    def reset_hash(self) -> None:
        self.block_hash = None

    def __repr__(self) -> str:
        h = self.block_hash
        if h is not None:  # a group's key (group, hash) beyond the first group
            h = h.hex()[:8] if first_group_key(h) else f"{h[0]}:{h[1].hex()[:8]}"
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail.

    The head is evicted first (LRU). ``remove`` takes a block out of the middle in O(1):
    a prefix-cache hit revives a free cached block that way. Invariant kept by the pool:
    a block is in this queue iff its ``ref_cnt`` is 0 (the null block aside).
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop ``n`` blocks from the head; ValueError (nothing popped) if fewer are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


# -- KV cache groups (the hybrid KV cache: sliding-window layers free what they passed) --
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_peak_blocks(
    num_tokens: int, block_size: int, window: int | None, max_chunk: int | None
) -> int:
    """The most blocks one KV cache group holds for a sequence of ``num_tokens``
    computed in steps of at most ``max_chunk`` tokens (None: all at once). A
    full-attention group (``window`` None) holds every block; a sliding-window group
    holds the blocks of a step's tokens and of the ``window - 1`` positions before the
    step's first (the blocks behind them are freed as the window passes), plus one for
    a window that does not start on a block boundary."""
    full = cdiv(num_tokens, block_size)
    if window is None:
        return full
    chunk = num_tokens if max_chunk is None else min(max_chunk, num_tokens)
    return min(full, cdiv(window - 1 + chunk, block_size) + 1)


def blocks_for_sequence(
    num_tokens: int, block_size: int, windows: Sequence[int | None], max_chunk: int | None
) -> int:
    """Blocks a sequence of ``num_tokens`` needs at its peak, over every group."""
    return sum(group_peak_blocks(num_tokens, block_size, w, max_chunk) for w in windows)


def kv_capacity_tokens(
    num_blocks: int,
    block_size: int,
    windows: Sequence[int | None] = (None,),
    max_chunk: int | None = None,
    limit: int = 1 << 40,
) -> int:
    """The longest sequence (at most ``limit`` tokens) whose blocks fit ``num_blocks``
    usable blocks (the null block excluded) over the groups of ``windows``. One
    full-attention group: ``num_blocks * block_size``."""
    if num_blocks <= 0:
        return 0
    if all(w is None for w in windows):  # the common case, exact and O(1)
        return min(limit, (num_blocks // len(windows)) * block_size)
    lo, hi = 0, limit  # blocks_for_sequence grows with the length: bisect it
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_for_sequence(mid, block_size, windows, max_chunk) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo
