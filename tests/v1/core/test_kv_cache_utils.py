from __future__ import annotations

import pytest
import torch

from vllm.multimodal.inputs import MultiModalFeature
from vllm.v1.core.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    get_request_block_hasher,
    hash_block_tokens,
)

from .conftest import make_request


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_fifo_and_middle_remove():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    q.remove(blocks[2])  # O(1) removal from the middle (a prefix hit revives it)
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 3]
    q.append(blocks[2])
    q.append_n([blocks[0], blocks[1]])
    assert ids(q.get_all_free_blocks()) == [4, 2, 0, 1]
    assert q.num_free_blocks == 4


def test_free_queue_errors():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already queued
    with pytest.raises(ValueError):
        q.popleft_n(3)
    q.popleft_n(2)
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[0])


def test_hash_chains_through_parent():
    a = hash_block_tokens(None, [1, 2], None)
    b = hash_block_tokens(a, [3, 4], None)
    assert hash_block_tokens(None, [1, 2], None) == a  # deterministic
    assert hash_block_tokens(hash_block_tokens(None, [9, 9], None), [3, 4], None) != b
    assert hash_block_tokens(None, [1, 2], ("salt", None)) != a


def test_request_hasher_only_full_blocks_and_incremental():
    req = make_request(list(range(10)), block_size=4)
    assert len(req.block_hashes) == 2  # 10 tokens: 2 full blocks of 4
    req.append_output_token_ids([10])
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([11])  # 12 tokens: the third block is full now
    assert len(req.block_hashes) == 3
    fresh = make_request(list(range(12)), block_size=4)
    assert fresh.block_hashes == req.block_hashes  # same tokens, same chain


def test_cache_salt_changes_every_block():
    plain = make_request(list(range(8)), block_size=4)
    salted = make_request(list(range(8)), block_size=4, cache_salt="tenant-a")
    assert all(x != y for x, y in zip(plain.block_hashes, salted.block_hashes, strict=True))


def test_an_image_enters_the_hash_of_each_block_its_placeholders_touch():
    # 14 tokens in blocks of 4: an image's placeholders at positions 5..8 (blocks 1 and 2).
    prompt = [1, 2, 3, 4, 5] + [9] * 4 + [6, 7, 8, 10, 11]

    def request(identifier, offset=5):
        image = MultiModalFeature("image", torch.zeros(3, 2, 2), offset, 4, identifier)
        return make_request(prompt, block_size=4, mm_features=[image])

    text, cat, dog = make_request(prompt, block_size=4), request("cat"), request("dog")
    assert cat.block_hashes[0] == dog.block_hashes[0] == text.block_hashes[0]  # before it
    assert (
        cat.block_hashes[1] != dog.block_hashes[1] and cat.block_hashes[1] != text.block_hashes[1]
    )
    assert cat.block_hashes[2] != dog.block_hashes[2]  # and after: the chain carries it
    assert request("cat").block_hashes == cat.block_hashes  # the same image: shared
    # The same image one position later (other text before it) is another prefix.
    assert request("cat", offset=4).block_hashes[1] != cat.block_hashes[1]


def test_block_hasher_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        get_request_block_hasher(0)
