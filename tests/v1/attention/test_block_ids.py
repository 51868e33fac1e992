"""BlockIds (a request's block ids as a list plus a numpy copy grown with it) and the
metadata builders that read the copy: the same tensors as from plain lists."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm.v1.attention.backends.abstract import BlockIds, block_array
from vllm.v1.attention.backends.torch_flash import build_triton_decode_metadata
from vllm.v1.attention.backends.varlen_metadata import build_varlen_metadata


def test_the_array_follows_every_growth():
    ids = BlockIds([3, 1])
    assert ids == [3, 1] and ids.array.dtype == np.int64
    for step in range(200):  # past several reallocations
        if step % 3:
            ids.append(step)
        else:
            ids.extend([step, step + 1000])
        assert ids.array.tolist() == list(ids)
    assert block_array(ids) is not None and block_array([4, 5]).tolist() == [4, 5]
    assert isinstance(ids[:3], list) and ids[-1] == ids.array[-1]


def _layouts(seed: int, block_size: int):
    rng = random.Random(seed)
    seqs = []
    next_block = 1
    for _ in range(rng.randint(1, 12)):
        computed = rng.randint(0, 70)
        new = 1 if rng.random() < 0.6 else rng.randint(1, 20)
        need = -(-(computed + new) // block_size) + rng.randint(0, 2)  # spare blocks too
        ids = list(range(next_block, next_block + need))
        rng.shuffle(ids)
        next_block += need
        seqs.append((computed, new, ids))
    return seqs


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("block_size", [4, 16])
def test_builders_give_the_same_metadata_from_lists_and_block_ids(seed, block_size):
    seqs = _layouts(seed, block_size)
    wrapped = [(c, n, BlockIds(ids)) for c, n, ids in seqs]
    for build in (
        lambda s: build_triton_decode_metadata(s, block_size, "cpu", paged=False),
        lambda s: build_varlen_metadata(s, block_size, "cpu", paged=False),
        lambda s: build_varlen_metadata(s, block_size, "cpu", paged=True),
    ):
        a, b = build(seqs), build(wrapped)
        for name, value in vars(a).items():
            other = getattr(b, name)
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), name
            elif name != "prefill":
                assert value == other, name


def test_too_few_blocks_is_still_refused():
    with pytest.raises(ValueError, match="2 blocks of 4 cannot hold 10"):
        build_triton_decode_metadata([(9, 1, BlockIds([5, 2]))], 4, "cpu", paged=False)
