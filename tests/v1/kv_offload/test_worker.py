"""The native backend's copies: runs, order (saves before loads), real copies."""

from __future__ import annotations

import torch

from vllm.v1.core.sched.output import KVOffloadTransfers
from vllm.v1.kv_offload.registry import get_offloading_backend_class
from vllm.v1.kv_offload.worker import CPUOffloadingHandler, copy_runs


def test_copy_runs_merge_blocks_consecutive_on_both_sides():
    assert copy_runs([(3, 0), (4, 1), (5, 2), (9, 3), (2, 4)]) == [(3, 0, 3), (9, 3, 1), (2, 4, 1)]
    assert copy_runs([]) == []


def test_saves_run_before_loads_and_copies_do_not_alias():
    # 2 layers of [2, 6 blocks, 4 tokens, 1 head, 2 dims]; block i filled with i.
    caches = [torch.arange(6.0).view(1, 6, 1, 1, 1).expand(2, 6, 4, 1, 2).clone() for _ in "ab"]
    handler = get_offloading_backend_class("native")(caches, 3)
    assert isinstance(handler, CPUOffloadingHandler)
    assert handler.block_bytes == 2 * 2 * 4 * 1 * 2 * 4  # layers * K/V * slots * dims * fp32
    # Save blocks 4, 5 to tier 0, 1; in the same step load tier 0 into block 4 (the block
    # just saved: a save reads it first) and tier 1 into block 2.
    handler.transfer(KVOffloadTransfers(saves=[(4, 0), (5, 1)], loads=[(0, 4), (1, 2)]))
    for layer, tier in zip(caches, handler.cpu_caches, strict=True):
        assert torch.all(tier[:, 0] == 4) and torch.all(tier[:, 1] == 5)
        assert torch.all(layer[:, 4] == 4) and torch.all(layer[:, 2] == 5)
    caches[0][:, 2] = -1  # the tier keeps its own copy
    assert torch.all(handler.cpu_caches[0][:, 1] == 5)
