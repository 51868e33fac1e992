"""The torch backend's metadata on CUDA reads nothing back from the device: the decodes'
padded width is a host int (it was ``int(decode_seq_lens.max())``, a sync per step)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm.v1.attention.backends import torch_sdpa

# block_size 4: decodes over 10 and 3 cached tokens, then a prompt of 5.
SEQS = [(10, 1, [3, 7, 2]), (3, 1, [8]), (0, 5, [4, 5])]


def test_decode_width_is_a_host_int():
    meta = torch_sdpa.build_metadata(SEQS, 4, "cpu")
    assert meta.decode_max_len == 11 and isinstance(meta.decode_max_len, int)
    assert meta.decode_mask.shape == (2, 1, 1, 11)
    assert meta.decode_slots.tolist() == [
        [12, 13, 14, 15, 28, 29, 30, 31, 8, 9, 10],
        [32, 33, 34, 35, 0, 0, 0, 0, 0, 0, 0],
    ]


def test_decode_gather_indices_on_fake_cuda_tensors():
    # Under FakeTensorMode a read of a device value raises: none happens here.
    with FakeTensorMode():
        dev = torch.device("cuda", 0)
        meta = torch_sdpa.build_metadata(SEQS, 4, dev)
        assert meta.decode_slots.shape == (2, 11) and meta.decode_slots.device == dev
        assert meta.decode_mask.device == dev
