"""Per-step metadata of the varlen FlashAttention backends (``TORCH_FLASH_ATTN``,
``FLASH_ATTN``): one flat batch, sequence ``i`` owning query rows
``cu_seq_q[i]:cu_seq_q[i+1]`` and ``seqused_k[i]`` keys (its cached context plus this
step's tokens, written to the cache before the kernel runs).

Everything is computed on the host from the scheduler's lists, packed into one byte buffer
and copied to the device once (pinned, non-blocking on CUDA); the tensors the kernels take
are views into that one copy. Nothing here or in a forward reads a device value back, so a
step makes no host sync for its attention metadata.

Two ways to hand the keys to the kernel, fixed per backend instance:

- **paged**: ``block_table`` (``(num_seqs, max_blocks)`` int32, rows padded with the null
  block 0, which no sequence reads past its ``seqused_k``) over the cache viewed as
  ``(num_blocks, block_size, kv_heads, head_dim)``.
- **gathered**: ``gather_slots`` (int64, every sequence's context slots concatenated in
  batch order): the forward gathers them into packed ``(total_k, kv_heads, head_dim)``
  K/V and passes ``cu_seq_k``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.utils.device import upload
from vllm.v1.attention.backends.abstract import SeqLayout, block_array
from vllm.v1.attention.backends.torch_sdpa import PrefillChunk, both_ways_chunks

# FlashAttention-2's kernels (the flash-attn package's and torch's own) take head sizes that
# are multiples of 8 up to this.
MAX_HEAD_DIM = 256


class FlashAttentionLimits:
    """Where both FlashAttention backends can run (a mixin ahead of ``AttentionBackend``):
    a CUDA device that is present, head sizes of a multiple of 8 up to ``MAX_HEAD_DIM``."""

    device_types = ("cuda",)

    @classmethod
    def supports_device(cls, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size <= MAX_HEAD_DIM and head_size % 8 == 0


class BothWays:
    """Spans of rows that attend to each other both ways (the ``bidirectional_spans``
    feature: Gemma 3's images) on a backend whose kernel is causal only: the varlen
    kernel attends every row causally, then the spans' rows are attended again under an
    explicit mask (``torch_sdpa.attend_chunks``): only steps with images pay."""

    layout: list[SeqLayout] | None
    block_size: int
    both_ways: list[PrefillChunk]
    slot_mapping: torch.Tensor

    def attend_both_ways(self, spans: list[tuple[int, int]]) -> None:
        """Rows ``[a, b)`` of the step's flat batch, each inside one sequence, see each
        other (``torch_sdpa.both_ways_chunks``)."""
        device = self.slot_mapping.device
        self.both_ways += both_ways_chunks(self.layout, spans, self.block_size, device)

    def causal(self) -> BothWays:
        """This step's metadata with every row attending causally (a shallow copy without
        the spans; itself when it has none): for the layers whose image tokens do not see
        each other both ways (Gemma 4's global layers)."""
        if not self.both_ways:
            return self
        out = copy.copy(self)
        out.both_ways = []
        return out


@dataclass
class VarlenMetadata(BothWays):
    """One step's inputs of a varlen attention kernel, shared by every layer."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: where each new token's K/V goes
    cu_seq_q: torch.Tensor  # (num_seqs + 1,) int32
    cu_seq_k: torch.Tensor  # (num_seqs + 1,) int32: cumulative context lengths
    seqused_k: torch.Tensor  # (num_seqs,) int32: context + new tokens per sequence
    block_table: torch.Tensor  # (num_seqs, max_blocks) int32, padded with block 0
    max_q: int  # host ints: the kernel's grid, never read back from the device
    max_k: int
    paged: bool
    gather_slots: torch.Tensor | None = None  # (total_k,) int64; None when paged
    # The step's sequences (``build_*``'s ``seqs``) and block size, by which spans that
    # attend both ways are placed; the spans as chunks to attend again (``BothWays``).
    layout: list[SeqLayout] | None = None
    block_size: int = 0
    both_ways: list[PrefillChunk] = field(default_factory=list)


def _cumsum(lens: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lens, dtype=np.int64)])


def _host_tables(
    seqs: list[SeqLayout], block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(computed, total, block table, context slots) on the host, int64; the slots are
    ``(num_seqs, max_blocks * block_size)``: row ``i``'s position ``p`` at column ``p``."""
    computed = np.array([c for c, _, _ in seqs], dtype=np.int64)
    total = computed + np.array([n for _, n, _ in seqs], dtype=np.int64)
    rows = [block_array(ids)[: -(-(c + n) // block_size)] for c, n, ids in seqs]
    for (c, n, ids), row in zip(seqs, rows, strict=True):
        if len(row) * block_size < c + n:
            raise ValueError(f"{len(ids)} blocks of {block_size} cannot hold {c + n} tokens")
    width = max((len(r) for r in rows), default=0)
    table = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    offsets = np.arange(block_size, dtype=np.int64)
    slots = (table[:, :, None] * block_size + offsets).reshape(len(rows), width * block_size)
    return computed, total, table, slots


def _pack(parts32: list[np.ndarray], parts64: list[np.ndarray]) -> torch.Tensor:
    """One host byte buffer: the int32 parts, padding to 8 bytes, then the int64 parts."""
    flat32 = np.concatenate([p.reshape(-1).astype(np.int32) for p in parts32])
    flat64 = np.concatenate([p.reshape(-1).astype(np.int64) for p in parts64])
    pad = np.zeros(4 * (flat32.size % 2), dtype=np.uint8)
    return torch.from_numpy(np.concatenate([flat32.view(np.uint8), pad, flat64.view(np.uint8)]))


def build_varlen_metadata(
    seqs: list[SeqLayout], block_size: int, device: torch.device | str, paged: bool
) -> VarlenMetadata:
    """``seqs``: per request in batch order, (num_computed, num_new, block_ids); decodes
    and prefill chunks in any order. ``paged``: the kernel reads the cache through
    ``block_table`` (else ``gather_slots`` is built). One host-to-device copy."""
    device = torch.device(device)
    computed, total, table, slots = _host_tables(seqs, block_size)
    pos = np.arange(slots.shape[1], dtype=np.int64)
    in_context = pos[None, :] < total[:, None]
    new_mask = in_context & (pos[None, :] >= computed[:, None])
    slot_mapping = slots[new_mask]  # row-major: batch order, then position
    q_lens = total - computed
    parts32 = [_cumsum(q_lens), _cumsum(total), total, table]
    parts64 = [slot_mapping] + ([] if paged else [slots[in_context]])
    dev = upload(_pack(parts32, parts64), device)

    n, width, num_tokens = len(seqs), table.shape[1], slot_mapping.size
    sizes32 = [n + 1, n + 1, n, n * width]
    end32 = sum(sizes32)
    # narrow/split, not slicing: they also run on FakeTensorMode's CUDA tensors (tests).
    start64 = 4 * (end32 + end32 % 2)
    ints = dev.narrow(0, 0, 4 * end32).view(torch.int32)
    cu_q, cu_k, used, flat_table = ints.split(sizes32)
    longs = dev.narrow(0, start64, dev.numel() - start64).view(torch.int64)
    slot_mapping, gather_slots = longs.split([num_tokens, longs.numel() - num_tokens])
    return VarlenMetadata(
        slot_mapping=slot_mapping,
        cu_seq_q=cu_q,
        cu_seq_k=cu_k,
        seqused_k=used,
        block_table=flat_table.view(n, width),
        max_q=int(q_lens.max(initial=0)),  # host arrays: no device read
        max_k=int(total.max(initial=0)),
        paged=paged,
        gather_slots=None if paged else gather_slots,
        layout=seqs,
        block_size=block_size,
    )
