"""The runner's side of the CPU KV tier: the tier's tensors and the block copies.

The tier mirrors the KV cache's layout, one tensor per layer of shape
``[2, num_cpu_blocks, block_size, num_kv_heads, head_size]``, so a block is two
contiguous chunks (K and V) per layer on both sides. Copies are grouped into runs of
consecutive block ids on both sides, one ``copy_`` per run, layer and K/V: a request's
blocks are mostly consecutive, so a context moves in a few large copies.

On CPU the tier is plain memory and a copy is a memcpy, done before the forward pass.
On CUDA (untested here: no GPU) the tier is pinned host memory and the copies run on a
side stream with ``non_blocking=True``; the side stream first waits for the compute
stream (the blocks saved were written by the previous forward) and the compute stream
then waits for the side stream (this forward reads the loaded blocks and overwrites the
saved ones). The host never touches the tier's memory, so no host synchronisation is
needed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from vllm.v1.core.sched.output import KVOffloadTransfers

logger = logging.getLogger(__name__)

# (source start, destination start, number of blocks)
Run = tuple[int, int, int]


def copy_runs(pairs: Sequence[tuple[int, int]]) -> list[Run]:
    """(src, dst) block pairs, in order, merged into runs consecutive on both sides."""
    runs: list[Run] = []
    for src, dst in pairs:
        if runs:
            s0, d0, n = runs[-1]
            if src == s0 + n and dst == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((src, dst, 1))
    return runs


class CPUOffloadingHandler:
    """The ``native`` backend: ``num_blocks`` KV blocks per layer in host memory.

    ``transfer`` mutates the tier's tensors (saves) and the KV cache's (loads); it must
    run before the forward pass of the step whose ``SchedulerOutput`` carried the plan.
    """

    def __init__(self, kv_caches: Sequence[torch.Tensor], num_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("initialize the KV cache before the CPU tier")
        self.gpu_caches = list(kv_caches)
        self.num_blocks = num_blocks
        device = self.gpu_caches[0].device
        self.stream: torch.cuda.Stream | None = None
        pin = False
        if device.type == "cuda" and torch.cuda.is_available():
            self.stream = torch.cuda.Stream(device=device)
            pin = True
        self.cpu_caches = [
            torch.empty(
                (layer.shape[0], num_blocks, *layer.shape[2:]),
                dtype=layer.dtype,
                device="cpu",
                pin_memory=pin,
            )
            for layer in self.gpu_caches
        ]
        self.block_bytes = sum(t[:, 0].numel() * t.element_size() for t in self.cpu_caches)

    @property
    def size_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def transfer(self, plan: KVOffloadTransfers) -> None:
        """Run every save, then every load (the plan's contract)."""
        if self.stream is None:
            self._copy(plan.saves, self.gpu_caches, self.cpu_caches, non_blocking=False)
            self._copy(plan.loads, self.cpu_caches, self.gpu_caches, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(plan.saves, self.gpu_caches, self.cpu_caches, non_blocking=True)
            self._copy(plan.loads, self.cpu_caches, self.gpu_caches, non_blocking=True)
        compute.wait_stream(self.stream)

    @staticmethod
    def _copy(
        pairs: Sequence[tuple[int, int]],
        src_caches: Sequence[torch.Tensor],
        dst_caches: Sequence[torch.Tensor],
        non_blocking: bool,
    ) -> None:
        for s0, d0, n in copy_runs(pairs):
            for src, dst in zip(src_caches, dst_caches, strict=True):
                for kv in range(src.shape[0]):  # K and V: each run is contiguous in both
                    dst[kv, d0 : d0 + n].copy_(src[kv, s0 : s0 + n], non_blocking=non_blocking)
