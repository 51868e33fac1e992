"""``TRITON_MLA``: attention for multi-head latent attention models (DeepSeek-V2/V3) on
CUDA, over the latent cache (keys only: a value is its key's first ``value_size`` dims,
backends/abstract.py).

FlashAttention takes heads up to 256 wide, and MLA's absorbed head is 576 (512 latent +
64 rotated key), so before this backend such a model ran TORCH_SDPA on CUDA: masked SDPA
over a gather of every decode's context per layer, no CUDA graphs. Here:

- **decode rows** (the batch's leading rows of one new token each) go to the Triton MLA
  kernel (``triton_mla_decode``), which reads the latent rows in place through the block
  table on a grid fixed by the number of decodes: a decode-only step gathers nothing,
  reads no device value on the host, and is captured in CUDA graphs
  (``supports_decode_graphs``, ``graph_metadata``);
- **prefill rows** (prompts, chunks over a cached prefix) go to the Triton MLA prefill
  kernel (``triton_mla_prefill``): causal attention of each chunk's rows, all heads
  absorbed (576 wide), over the sequence's latent rows read in place through its block
  table (the chunk's own rows are written first), a program per tile of query rows x
  heads so that one key tile serves them all, an online softmax; nothing gathered and no
  scores materialised (SDPA at head size 576 has no FlashAttention kernel and built the
  scores: GBs for a long agent context in 8k-token chunks). Where Triton cannot run
  prefill (``prefill_kernel`` False: CPU tensors outside Triton's interpreter, as the
  tests' emulated decode kernel), the chunks take TORCH_SDPA's path, SDPA per chunk over
  its gathered prefix (``torch_sdpa.prefill_attention``). Such steps are not graphed.

Decodes come first in the batch (``decodes_first``; the runner orders them so): a leading
row of one new token is a decode whatever its cached context (a one-token prompt, or a
CUDA graph's padding row, attends to itself alone), and every row after the first longer
one is a prefill chunk.

The backend serves MLA models only (``required_features``), so the selector never offers
it to another model; priority 30 puts it ahead of the FlashAttention backends, which
cannot read the latent cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from vllm._custom_ops import reshape_and_cache_torch
from vllm.v1.attention.backends.abstract import AttentionBackend, SeqLayout, block_array
from vllm.v1.attention.backends.torch_flash import _upload
from vllm.v1.attention.backends.torch_sdpa import PrefillChunk, cache_views, prefill_attention
from vllm.v1.attention.kv_cache_dtype import as_stored


@dataclass
class MLAPrefillMetadata:
    """A step's prefill chunks as the Triton prefill kernel takes them: chunk ``i`` is
    rows ``cu_seq_q[i]:cu_seq_q[i+1]`` of the batch (after the decodes), over its
    ``seq_lens[i]`` keys (prefix and chunk) in blocks ``block_table[i]``."""

    block_table: torch.Tensor  # (num_chunks, max_blocks) int32, padded with block 0
    seq_lens: torch.Tensor  # (num_chunks,) int32
    cu_seq_q: torch.Tensor  # (num_chunks + 1,) int32: absolute rows of q and out
    max_q: int  # the longest chunk: a host integer, the kernel's grid


@dataclass
class MLAMetadata:
    """One step: decodes ``0..num_decodes-1`` are its first rows, decode ``i`` with
    ``seq_lens[i]`` keys in blocks ``block_table[i]``; the other rows are prefill chunks,
    described for the Triton prefill kernel (``prefill``) or, where it cannot run, for
    SDPA over gathered rows (``prefills``); one of the two, never both."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: every new token's slot, batch order
    block_table: torch.Tensor  # (num_decodes, max_blocks) int32, padded with block 0
    seq_lens: torch.Tensor  # (num_decodes,) int32
    num_decodes: int  # a host integer: the kernel's grid
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill: MLAPrefillMetadata | None = None

    @property
    def has_prefills(self) -> bool:
        return bool(self.prefills) or self.prefill is not None

    def narrow(self, num_seqs: int) -> MLAMetadata:
        """The first ``num_seqs`` decodes of a decode-only step, as views of these tensors."""
        if self.has_prefills:
            raise ValueError("only a decode-only step's metadata can be narrowed")
        return MLAMetadata(
            slot_mapping=self.slot_mapping.narrow(0, 0, num_seqs),
            block_table=self.block_table.narrow(0, 0, num_seqs),
            seq_lens=self.seq_lens.narrow(0, 0, num_seqs),
            num_decodes=num_seqs,
        )

    def copy_(self, src: MLAMetadata) -> None:
        """Take ``src``'s step into these tensors (the mutation), so that a CUDA graph
        captured with this metadata replays ``src``'s step: both decode-only with as many
        decodes, ``src``'s table no wider (the rest of each row becomes block 0)."""
        if self.has_prefills or src.has_prefills:
            raise ValueError("only a decode-only step's metadata can be copied")
        width = src.block_table.shape[1]
        if src.num_decodes != self.num_decodes or width > self.block_table.shape[1]:
            raise ValueError(
                f"a step of {tuple(src.block_table.shape)} does not fit "
                f"{tuple(self.block_table.shape)}"
            )
        self.slot_mapping.copy_(src.slot_mapping)
        self.seq_lens.copy_(src.seq_lens)
        self.block_table.narrow(1, 0, width).copy_(src.block_table)
        self.block_table.narrow(1, width, self.block_table.shape[1] - width).zero_()


def _slots(computed: int, end: int, block_ids, block_size: int) -> np.ndarray:
    if len(block_ids) * block_size < end:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {end} tokens")
    pos = np.arange(computed, end, dtype=np.int64)
    return block_array(block_ids)[pos // block_size] * block_size + pos % block_size


def build_mla_metadata(
    seqs: list[SeqLayout], block_size: int, device: torch.device | str, prefill_kernel: bool = False
) -> MLAMetadata:
    """``seqs`` in batch order, the decodes (one new token) leading; one host-to-device
    copy for the whole step. ``prefill_kernel``: the chunks as the Triton prefill kernel
    takes them (``MLAMetadata.prefill``), else as SDPA's (``prefills``)."""
    device = torch.device(device)
    num_decodes = next((i for i, (_, n, _) in enumerate(seqs) if n != 1), len(seqs))
    lens = np.array([c + n for c, n, _ in seqs], dtype=np.int64)
    needs = -(-lens // block_size)
    table = np.zeros((len(seqs), int(needs.max(initial=0))), dtype=np.int64)
    new_slots: list[np.ndarray] = []  # per sequence, its new tokens' slots
    contexts: list[np.ndarray] = []  # the whole context's slots of a chunk with a prefix
    chunks: list[PrefillChunk] = []
    with_prefix: list[PrefillChunk] = []
    starts = [0]
    for i, (computed, new, ids) in enumerate(seqs):
        if i < num_decodes or prefill_kernel:
            new_slots.append(_slots(computed, computed + new, ids, block_size))
            table[i, : needs[i]] = block_array(ids)[: needs[i]]
        else:
            chunks.append(PrefillChunk(starts[-1], new))
            context = _slots(0, computed + new, ids, block_size)
            new_slots.append(context[computed:])
            if computed:
                contexts.append(context)
                with_prefix.append(chunks[-1])
        starts.append(starts[-1] + new)
    decode_table = table[:num_decodes, : int(needs[:num_decodes].max(initial=0))]
    parts32 = [decode_table, lens[:num_decodes]]
    num_chunks = len(seqs) - num_decodes
    if prefill_kernel and num_chunks:
        parts32 += [table[num_decodes:], lens[num_decodes:], np.array(starts[num_decodes:])]
    parts64 = [np.concatenate(new_slots or [np.zeros(0, dtype=np.int64)]), *contexts]
    (table_t, lens_t, *chunk_t), (slot_mapping, *context_t) = _upload(parts32, parts64, device)
    for chunk, slots in zip(with_prefix, context_t, strict=True):
        chunk.context_slots = slots
    prefill = None
    if chunk_t:
        chunk_table, chunk_lens, cu_seq_q = chunk_t
        prefill = MLAPrefillMetadata(
            block_table=chunk_table.view(num_chunks, table.shape[1]),
            seq_lens=chunk_lens,
            cu_seq_q=cu_seq_q,
            max_q=max(n for _, n, _ in seqs[num_decodes:]),
        )
    return MLAMetadata(
        slot_mapping=slot_mapping,
        block_table=table_t.view(decode_table.shape),
        seq_lens=lens_t,
        num_decodes=num_decodes,
        prefills=chunks,
        prefill=prefill,
    )


class TritonMLABackend(AttentionBackend):
    """The module docstring's backend: CUDA, fp16/bf16/fp32, a latent cache in the model's
    dtype or FP8, any block size."""

    name = "TRITON_MLA"
    priority = 30
    decodes_first = True
    device_types = ("cuda",)
    supported_features: ClassVar[frozenset[str]] = frozenset({"latent_kv", "fp8_kv_cache"})
    required_features: ClassVar[frozenset[str]] = frozenset({"latent_kv"})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.value_size is None or self.value_size >= self.head_size:
            raise ValueError(f"{self.name} reads a latent cache: value_size < head_size")
        if self.num_kv_heads != 1:
            raise ValueError(f"{self.name}: one latent head per token, not {self.num_kv_heads}")
        from vllm.v1.attention.backends import triton_mla_prefill

        # Where Triton cannot run prefill (CPU tensors outside its interpreter: the tests'
        # emulated decode kernel), chunks take SDPA over gathered rows.
        self.prefill_kernel = triton_mla_prefill.prefill_unavailable_reason(self.device) is None

    @classmethod
    def supports_device(cls, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available()

    @classmethod
    def validate_configuration(
        cls, device: torch.device, dtype: torch.dtype, block_size: int, head_size: int
    ) -> list[str]:
        reasons = super().validate_configuration(device, dtype, block_size, head_size)
        if not reasons:  # the triton import last
            from vllm.v1.attention.backends import triton_mla_decode

            reason = triton_mla_decode.triton_unavailable_reason(device)
            if reason:
                reasons.append(reason)
        return reasons

    @property
    def detail(self) -> str:
        prefill = "Triton MLA prefill kernel" if self.prefill_kernel else "SDPA over gathered rows"
        return f"decode rows: Triton MLA kernel; prefill chunks: {prefill}"

    def warm_up(self, kv_caches: list[torch.Tensor], max_num_seqs: int) -> int:
        """Compile the decode kernel's split variants and the prefill kernel (one launch of
        a one-row chunk on the null block 0) before the first request meets them."""
        if not kv_caches:
            return 0
        from vllm.v1.attention.backends import triton_mla_decode, triton_mla_prefill

        launches = triton_mla_decode.warm_up(
            kv_caches[0], self.num_heads, self.value_size, max_num_seqs
        )
        if self.prefill_kernel:
            triton_mla_prefill.warm_up(kv_caches[0], self.num_heads, self.value_size, self.dtype)
            launches += 1
        return launches

    @property
    def supports_decode_graphs(self) -> bool:
        return True

    def graph_metadata(self, num_seqs: int, max_blocks: int) -> MLAMetadata:
        return MLAMetadata(
            slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=self.device),
            block_table=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=self.device),
            num_decodes=num_seqs,
        )

    def build_metadata(self, seqs: list[SeqLayout]) -> MLAMetadata:
        return build_mla_metadata(seqs, self.block_size, self.device, self.prefill_kernel)

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_size): [q_latent | q_pe]
        k: torch.Tensor,  # (num_tokens, 1, head_size): the latent rows to cache
        v: torch.Tensor | None,  # None: the values are the keys' first value_size dims
        kv_cache: torch.Tensor,  # (1, num_blocks, block_size, 1, head_size)
        meta: MLAMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write the step's latent rows, then attend; returns (num_tokens, heads,
        value_size)."""
        from vllm.v1.attention.backends import triton_mla_decode, triton_mla_prefill

        if v is not None:
            raise ValueError(f"{self.name} caches keys only: v must be None")
        # The metadata's slots come from block ids: none is padding.
        reshape_and_cache_torch(k, None, kv_cache, meta.slot_mapping, padded=False)
        out = q.new_empty(q.shape[0], q.shape[1], self.value_size)
        if meta.num_decodes:
            triton_mla_decode.mla_decode_attention(
                q, kv_cache, meta.block_table, meta.seq_lens, scale, self.value_size, out=out
            )
        if meta.prefill is not None:  # the chunks' own rows are in the cache already
            p = meta.prefill
            triton_mla_prefill.mla_prefill_attention(
                q, kv_cache, p.block_table, p.seq_lens, p.cu_seq_q, p.max_q, scale,
                self.value_size, out=out,
            )  # fmt: skip
        if meta.prefills:  # a chunk's own rows as the cache holds them (FP8: rounded)
            k = as_stored(k, kv_cache.dtype)
            flat_k, flat_v = cache_views(kv_cache, self.value_size)
            v = k[..., : self.value_size]
            prefill_attention(out, q, k, v, flat_k, flat_v, meta.prefills, scale)
        return out
