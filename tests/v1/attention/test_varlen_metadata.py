"""The varlen backends' per-step metadata (block tables, cu_seq, seqused_k, slots), built
on the host and copied to the device once."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention.backends.varlen_metadata import build_varlen_metadata

CPU = torch.device("cpu")

# block_size 4. Per sequence (computed, new, blocks) -> context length, blocks used:
#   decode     (5, 1, [3, 7])     -> 6,  [3, 7]
#   prefill    (0, 6, [2, 9, 11]) -> 6,  [2, 9]  (block 11: allocated ahead, unused)
#   chunk      (8, 3, [4, 5, 6])  -> 11, [4, 5, 6] (8 prefix tokens cached)
#   decode     (3, 1, [8])        -> 4,  [8]
MIXED = [(5, 1, [3, 7]), (0, 6, [2, 9, 11]), (8, 3, [4, 5, 6]), (3, 1, [8])]


def test_mixed_batch_with_prefixes_gathered():
    meta = build_varlen_metadata(MIXED, 4, CPU, paged=False)
    assert meta.cu_seq_q.tolist() == [0, 1, 7, 10, 11]
    assert meta.cu_seq_k.tolist() == [0, 6, 12, 23, 27]
    assert meta.seqused_k.tolist() == [6, 6, 11, 4]
    assert (meta.max_q, meta.max_k) == (6, 11)
    for t in (meta.cu_seq_q, meta.cu_seq_k, meta.seqused_k, meta.block_table):
        assert t.dtype == torch.int32 and t.is_contiguous()  # what FlashAttention checks
    assert meta.slot_mapping.dtype == meta.gather_slots.dtype == torch.int64
    # Rows padded with the null block 0.
    assert meta.block_table.tolist() == [[3, 7, 0], [2, 9, 0], [4, 5, 6], [8, 0, 0]]
    # slot = block * 4 + offset, for the new tokens only, in batch order.
    assert meta.slot_mapping.tolist() == [29, 8, 9, 10, 11, 36, 37, 24, 25, 26, 35]
    assert not meta.paged
    # Every context slot (cached prefix + new tokens), sequence after sequence.
    assert meta.gather_slots.tolist() == (
        [12, 13, 14, 15, 28, 29] + [8, 9, 10, 11, 36, 37] + list(range(16, 27)) + [32, 33, 34, 35]
    )


def test_paged_has_no_gather_slots():
    # 300 cached tokens + 1 new over pages of 256: the new token is position 44 of block 2.
    meta = build_varlen_metadata([(300, 1, [5, 2]), (0, 3, [7])], 256, CPU, paged=True)
    assert meta.paged and meta.gather_slots is None
    assert meta.block_table.tolist() == [[5, 2], [7, 0]]
    assert meta.seqused_k.tolist() == [301, 3]
    assert meta.cu_seq_q.tolist() == [0, 1, 4]
    assert meta.slot_mapping.tolist() == [2 * 256 + 44, 7 * 256, 7 * 256 + 1, 7 * 256 + 2]
    assert (meta.max_q, meta.max_k) == (3, 301)


@pytest.mark.parametrize("paged", [False, True])
def test_every_tensor_is_a_view_of_one_copy(paged):
    # One host-to-device copy per step: all the tensors share one storage.
    meta = build_varlen_metadata(MIXED, 4, CPU, paged=paged)
    tensors = [meta.slot_mapping, meta.cu_seq_q, meta.cu_seq_k, meta.seqused_k, meta.block_table]
    if not paged:
        tensors.append(meta.gather_slots)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1


def test_odd_int32_count_keeps_the_int64_part_aligned():
    # One sequence of 1 block: 2 + 2 + 1 + 1 = 6 int32 values (even); two sequences of one
    # block each: 3 + 3 + 2 + 2 = 10; a block table of width 2 for one: 2 + 2 + 1 + 2 = 7.
    meta = build_varlen_metadata([(4, 1, [1, 3])], 4, CPU, paged=False)
    assert meta.slot_mapping.tolist() == [12]
    assert meta.gather_slots.tolist() == [4, 5, 6, 7, 12]
    assert meta.slot_mapping.data_ptr() % 8 == 0


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="1 blocks of 4 cannot hold 5 tokens"):
        build_varlen_metadata([(4, 1, [3])], 4, CPU, paged=False)
