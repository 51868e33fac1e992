"""Paged attention with torch's own FlashAttention kernels
(``torch.nn.attention.varlen.varlen_attn``: CUDA, fp16/bf16, nothing to build or install).

One ``varlen_attn`` call per layer covers the whole flat batch: decodes, whole prompts and
chunks over a cached prefix alike (``varlen_metadata`` holds the per-step layout, built
once and shared by every layer). The causal mask is FlashAttention-2's, aligned to the
bottom-right corner: query row ``j`` of a chunk of ``q_len`` over ``seq_len`` keys sees
keys ``[0, seq_len - q_len + j]``, which is what a chunk over a cached prefix needs. GQA
is native (``enable_gqa``): query head ``h`` reads KV head ``h // (heads // kv_heads)``.

What the installed torch offers is read from ``varlen_attn``'s signature, never from its
version (torch 2.11 has packed varlen with GQA; 2.13 adds ``block_table``/``seqused_k``):

- **paged** when ``varlen_attn`` takes ``block_table`` and ``seqused_k`` and the block
  size is a multiple of 256: the cache's ``(num_blocks, block_size, kv_heads, head_dim)``
  halves are the page pool. torch's FlashAttention-2 (``mha_varlen_fwd``) refuses other
  page sizes ("Paged KV cache block size must be divisible by 256").
- **gathered** otherwise (e.g. the default block size 16): the step's context slots are
  gathered into packed ``(total_k, kv_heads, head_dim)`` K/V per layer, passed with
  ``cu_seq_k``. One copy of the step's context K/V per layer, no per-shape planning.

Older signatures are met too: causal through ``is_causal=`` where there is no
``window_size=``, the scale folded into the query where there is no ``scale=``, K/V heads
repeated where there is no ``enable_gqa=``.

A sliding-window layer (``forward(..., sliding_window=w)``: Mistral v0.1, Gemma 2/3) asks
``varlen_attn`` for ``window_size=(w - 1, 0)`` (the query and the ``w - 1`` positions
before it) and the Triton decode kernel for its ``window``; a torch whose ``varlen_attn``
has no ``window_size=`` cannot run such a model (the selector passes over the backend).

Soft-capped scores (Gemma 2) and attention sinks (gpt-oss), which FlashAttention's kernels
do not compute, are Triton's: decode rows take them in the decode kernel; the other rows
of a soft-capped layer go to the Triton paged prefill kernel (``triton_prefill``), and
those of a layer with sinks to ``varlen_attn`` asked for its log-sum-exp (``return_aux``),
each output row then scaled by ``sigmoid(lse - sink)`` (the share of the softmax the sink
leaves: exact), or to the prefill kernel where this torch returns no log-sum-exp. Both
need triton installed (the selector passes over the backend otherwise).

An FP8 KV cache (``--kv-cache-dtype fp8``: the ``fp8_kv_cache`` feature) is gathered and
widened to the query's dtype for ``varlen_attn`` (never paged: torch's FlashAttention-2
reads no FP8), and read as bytes, decoded in registers, by the Triton kernels.

Decode rows (one new token over its cached context) go to the Triton paged decode kernel
(``triton_decode``) where it can run (CUDA, triton importable) unless
``VLLM_CUDA_DECODE_ATTENTION=varlen``: it reads the cache in place through the block
table, whatever the block size, on a launch grid fixed by the number of decodes, so a
decode step gathers nothing and can be captured in a CUDA graph. The step's other rows
(prompts, chunks) still go to ``varlen_attn`` as above, gathered or paged; a step without
decodes is built and run exactly as without Triton.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm import envs
from vllm._custom_ops import reshape_and_cache_torch
from vllm.utils.device import upload
from vllm.v1.attention.backends.abstract import AttentionBackend, SeqLayout, block_array
from vllm.v1.attention.backends.torch_sdpa import PrefillChunk, attend_chunks
from vllm.v1.attention.backends.varlen_metadata import (
    BothWays,
    FlashAttentionLimits,
    VarlenMetadata,
    build_varlen_metadata,
)

logger = logging.getLogger(__name__)

# torch's FlashAttention-2 reads a paged cache only with pages of a multiple of this.
PAGED_BLOCK_MULTIPLE = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)  # FlashAttention-2: Ampere or newer


def load_varlen_attn() -> Callable[..., torch.Tensor] | None:
    """torch's ``varlen_attn``, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@dataclass(frozen=True)
class VarlenFeatures:
    """What the installed ``varlen_attn`` accepts, read from its signature."""

    paged: bool  # block_table= and seqused_k=
    gqa: bool  # enable_gqa=
    scale: bool  # scale=
    causal: str | None  # the keyword that asks for a causal mask: window_size / is_causal
    lse: bool = False  # return_aux=: also returns the rows' log-sum-exp

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> VarlenFeatures:
        params = inspect.signature(fn).parameters
        causal = next((k for k in ("window_size", "is_causal") if k in params), None)
        return cls(
            paged="block_table" in params and "seqused_k" in params,
            gqa="enable_gqa" in params,
            scale="scale" in params,
            causal=causal,
            lse="return_aux" in params,
        )


def flash_unavailable_reason(device: torch.device) -> str | None:
    """Why torch's FlashAttention cannot run on ``device`` (None: it can): no
    ``varlen_attn``, a torch built without flash attention, or a GPU older than Ampere."""
    fn = load_varlen_attn()
    if fn is None:
        return "this torch has no torch.nn.attention.varlen.varlen_attn"
    if VarlenFeatures.of(fn).causal is None:
        return "torch's varlen_attn takes neither window_size= nor is_causal="
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch was built without FlashAttention"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return f"FlashAttention needs compute capability >= 8.0, the GPU has {capability}"
    return None


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def sink_scaled(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``varlen_attn``'s ``out`` (tokens, heads, dim) as if each head's sink logit had
    joined its softmax: the softmax's sum ``e^lse`` becomes ``e^lse + e^sink``, so every
    row scales by ``sigmoid(lse - sink)``. ``lse``: natural log-sum-exp of the scaled
    scores, (heads, tokens) as FlashAttention returns it, or (tokens, heads)."""
    tokens, heads = out.shape[0], out.shape[1]
    if lse.shape == (heads, tokens):
        lse = lse.t()
    elif lse.shape != (tokens, heads):
        raise RuntimeError(f"varlen_attn's log-sum-exp {tuple(lse.shape)} for {tuple(out.shape)}")
    share = torch.sigmoid(lse.float() - sinks.float())
    return (out.float() * share.unsqueeze(-1)).to(out.dtype)


def choose_decode_kernel(device: torch.device) -> str:
    """``"triton"`` or ``"varlen"``: the kernel of the decode rows, per
    ``VLLM_CUDA_DECODE_ATTENTION`` (auto: Triton where it can run). An explicit ``triton``
    that cannot run raises (no silent fallback)."""
    choice = envs.VLLM_CUDA_DECODE_ATTENTION
    if choice == "varlen":
        return "varlen"
    if device.type != "cuda":
        reason = f"the Triton decode kernel runs on CUDA, not {device.type}"
    elif not torch.cuda.is_available():
        reason = "no CUDA device is available"
    else:
        from vllm.v1.attention.backends import triton_decode  # imports triton: on CUDA only

        reason = triton_decode.triton_unavailable_reason(device)
        if reason is None:
            return "triton"
    if choice == "triton":
        raise RuntimeError(f"VLLM_CUDA_DECODE_ATTENTION=triton: {reason}")
    if device.type == "cuda":
        logger.info("Decode rows use varlen_attn: %s", reason)
    return "varlen"


@dataclass
class TritonDecodeMetadata(BothWays):
    """A step with decode rows for the Triton kernel: decode ``i`` (the ``i``-th
    single-token sequence in batch order) has ``seq_lens[i]`` keys, its own included, in
    blocks ``block_table[i]``; every other row goes to ``varlen_attn`` with ``prefill``."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: every new token's slot, batch order
    block_table: torch.Tensor  # (num_decodes, max_blocks) int32, padded with block 0
    seq_lens: torch.Tensor  # (num_decodes,) int32
    decode_rows: torch.Tensor | None  # (num_decodes,) int32; None: decode i is row i
    prefill_rows: torch.Tensor | None  # (num_prefill_tokens,) int64; None: no prefills
    prefill: VarlenMetadata | None  # over the prefill sequences alone
    layout: list[SeqLayout] | None = None  # as VarlenMetadata's (``BothWays``)
    block_size: int = 0
    both_ways: list[PrefillChunk] = field(default_factory=list)

    def narrow(self, num_seqs: int) -> TritonDecodeMetadata:
        """The first ``num_seqs`` decodes of a decode-only step, as views of these tensors."""
        if self.prefill is not None:
            raise ValueError("only a decode-only step's metadata can be narrowed")
        return TritonDecodeMetadata(
            slot_mapping=self.slot_mapping.narrow(0, 0, num_seqs),
            block_table=self.block_table.narrow(0, 0, num_seqs),
            seq_lens=self.seq_lens.narrow(0, 0, num_seqs),
            decode_rows=None,
            prefill_rows=None,
            prefill=None,
        )

    def copy_(self, src: TritonDecodeMetadata) -> None:
        """Take ``src``'s step into these tensors (the mutation), so that a CUDA graph
        captured with this metadata replays ``src``'s step: both decode-only with as many
        decodes, ``src``'s table no wider (the rest of each row becomes block 0)."""
        if self.prefill is not None or src.prefill is not None:
            raise ValueError("only a decode-only step's metadata can be copied")
        width = src.block_table.shape[1]
        if src.seq_lens.shape != self.seq_lens.shape or width > self.block_table.shape[1]:
            raise ValueError(
                f"a step of {src.block_table.shape} does not fit {self.block_table.shape}"
            )
        self.slot_mapping.copy_(src.slot_mapping)
        self.seq_lens.copy_(src.seq_lens)
        self.block_table.narrow(1, 0, width).copy_(src.block_table)
        self.block_table.narrow(1, width, self.block_table.shape[1] - width).zero_()


def _new_slots(computed: int, new: int, block_ids: Sequence[int], block_size: int) -> np.ndarray:
    _check_holds(block_ids, computed + new, block_size)
    pos = np.arange(computed, computed + new, dtype=np.int64)
    return block_array(block_ids)[pos // block_size] * block_size + pos % block_size


def _check_holds(block_ids: Sequence[int], tokens: int, block_size: int) -> None:
    if len(block_ids) * block_size < tokens:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {tokens} tokens")


def build_triton_decode_metadata(
    seqs: list[SeqLayout], block_size: int, device: torch.device | str, paged: bool
) -> TritonDecodeMetadata:
    """``seqs`` in batch order, in any mix; the decodes are those of one new token. One
    host-to-device copy, plus ``build_varlen_metadata``'s for the prefills if any."""
    device = torch.device(device)
    decodes = [i for i, (_, n, _) in enumerate(seqs) if n == 1]
    prefills = [i for i, (_, n, _) in enumerate(seqs) if n != 1]
    starts = np.cumsum([0] + [n for _, n, _ in seqs], dtype=np.int64)
    lens = np.array([seqs[i][0] + 1 for i in decodes], dtype=np.int64)
    needs = -(-lens // block_size)
    table = np.zeros((len(decodes), int(needs.max(initial=0))), dtype=np.int64)
    parts = []
    for i, need in zip(decodes, needs.tolist(), strict=True):
        computed, _, ids = seqs[i]
        _check_holds(ids, computed + 1, block_size)
        parts.append(block_array(ids)[:need])
    if parts:  # every row's blocks at once, row-major into the padded table
        table[np.arange(table.shape[1]) < needs[:, None]] = np.concatenate(parts)
    # A decode's one slot, from its row of the table (no per-request conversion).
    pos = lens - 1
    decode_slots = table[np.arange(len(decodes)), pos // block_size] * block_size
    decode_slots += pos % block_size
    slots: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(seqs)
    for row, i in enumerate(decodes):
        slots[i] = decode_slots[row : row + 1]
    for i in prefills:
        slots[i] = _new_slots(*seqs[i], block_size)
    rows = starts[decodes] if prefills else np.zeros(0, dtype=np.int64)
    prefill_rows = [np.arange(starts[i], starts[i + 1]) for i in prefills]
    parts32 = [table, lens, rows]
    parts64 = [np.concatenate(slots or [np.zeros(0)]), np.concatenate(prefill_rows or [rows])]
    (table_t, lens_t, rows_t), (slots_t, prefill_rows_t) = _upload(parts32, parts64, device)
    return TritonDecodeMetadata(
        slot_mapping=slots_t,
        block_table=table_t.view(table.shape),
        seq_lens=lens_t,
        decode_rows=rows_t if prefills else None,
        prefill_rows=prefill_rows_t if prefills else None,
        prefill=(
            build_varlen_metadata([seqs[i] for i in prefills], block_size, device, paged)
            if prefills
            else None
        ),
        layout=seqs,
        block_size=block_size,
    )


def _upload(
    parts32: list[np.ndarray], parts64: list[np.ndarray], device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The parts, flattened, as int32 / int64 views of one tensor on ``device`` (one copy)."""
    flat32 = np.concatenate([p.reshape(-1) for p in parts32]).astype(np.int32)
    flat64 = np.concatenate([p.reshape(-1) for p in parts64]).astype(np.int64)
    pad = np.zeros(4 * (flat32.size % 2), dtype=np.uint8)
    host = np.concatenate([flat32.view(np.uint8), pad, flat64.view(np.uint8)])
    dev = upload(torch.from_numpy(host), device)
    # narrow/split, not slicing: they also run on FakeTensorMode's CUDA tensors (tests).
    start64 = 4 * (flat32.size + flat32.size % 2)
    ints = dev.narrow(0, 0, 4 * flat32.size).view(torch.int32)
    longs = dev.narrow(0, start64, 8 * flat64.size).view(torch.int64)
    return (
        list(ints.split([p.size for p in parts32])),
        list(longs.split([p.size for p in parts64])),
    )


class TorchFlashAttentionBackend(FlashAttentionLimits, AttentionBackend):
    """``varlen_attn`` over the paged cache as a backend: CUDA, fp16/bf16, head size a
    multiple of 8 up to 256, any block size (paged where torch and the block size allow,
    gathered otherwise; see the module docstring). ``decode_kernel``: ``"triton"`` sends
    the decode rows to the Triton paged kernel, ``"varlen"`` every row to varlen_attn."""

    name = "TORCH_FLASH_ATTN"
    priority = 20  # ahead of FLASH_ATTN (the flash-attn package) and TORCH_SDPA
    decodes_first = False
    supported_dtypes = SUPPORTED_DTYPES
    supported_features = frozenset(
        {"sliding_window", "logits_soft_cap", "sinks", "fp8_kv_cache", "bidirectional_spans"}
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        attn = load_varlen_attn()
        if attn is None:
            raise RuntimeError(f"{self.name}: this torch has no varlen_attn")
        self._attn = attn
        self.features = VarlenFeatures.of(attn)
        self._paged = self.features.paged and self.block_size % PAGED_BLOCK_MULTIPLE == 0
        # Keyword arguments every call shares (the mask and the scale are added per call).
        self._kwargs: dict[str, Any] = {"enable_gqa": True} if self.features.gqa else {}
        self.decode_kernel = choose_decode_kernel(self.device)

    @classmethod
    def validate_configuration(
        cls, device: torch.device, dtype: torch.dtype, block_size: int, head_size: int
    ) -> list[str]:
        reasons = super().validate_configuration(device, dtype, block_size, head_size)
        if not reasons:  # the import and device query last: they are not free
            reason = flash_unavailable_reason(device)
            if reason:
                reasons.append(reason)
        return reasons

    @classmethod
    def unsupported_features(cls, features: frozenset[str]) -> list[str]:
        reasons = super().unsupported_features(features)
        fn = load_varlen_attn()
        if "sliding_window" in features and fn is not None:
            if VarlenFeatures.of(fn).causal != "window_size":
                reasons.append("sliding window attention needs varlen_attn's window_size=")
        if features & {"logits_soft_cap", "sinks"} and not triton_installed():
            names = " and ".join(
                sorted(f.replace("_", " ") for f in features & {"logits_soft_cap", "sinks"})
            )
            reasons.append(f"{names} need triton's kernels (triton is not installed)")
        return reasons

    @property
    def paged(self) -> bool:
        """``varlen_attn`` reads the cache through ``block_table`` (else gathered): where
        torch and the block size allow, and the cache is in the model's dtype (an FP8
        cache is gathered and widened: torch's FlashAttention-2 reads no FP8)."""
        return self._paged and "fp8_kv_cache" not in self.model_features

    @paged.setter
    def paged(self, value: bool) -> None:
        self._paged = value

    @property
    def detail(self) -> str:
        if self.paged:
            return f"paged KV through block_table (block size {self.block_size})"
        if not self.features.paged:
            why = "this torch's varlen_attn has no block_table"
        elif "fp8_kv_cache" in self.model_features:
            why = "the KV cache is FP8"
        else:
            why = f"block size {self.block_size} is not a multiple of {PAGED_BLOCK_MULTIPLE}"
        detail = f"{why}: contexts are gathered per step"
        if self.decode_kernel == "triton":
            detail = f"decode rows: Triton paged kernel; other rows: {detail}"
        return detail

    def warm_up(self, kv_caches: list[torch.Tensor], max_num_seqs: int) -> int:
        if self.decode_kernel != "triton" or not kv_caches:
            return 0
        from vllm.v1.attention.backends import triton_decode

        return triton_decode.warm_up(
            kv_caches[0],
            self.num_heads,
            max_num_seqs,
            soft_cap="logits_soft_cap" in self.model_features,
            sinks="sinks" in self.model_features,
        )

    @property
    def supports_decode_graphs(self) -> bool:
        # varlen_attn's gathered K/V change shape every step; the Triton kernel's do not.
        return self.decode_kernel == "triton"

    def graph_metadata(self, num_seqs: int, max_blocks: int) -> TritonDecodeMetadata:
        if not self.supports_decode_graphs:
            return super().graph_metadata(num_seqs, max_blocks)
        return TritonDecodeMetadata(
            slot_mapping=torch.zeros(num_seqs, dtype=torch.int64, device=self.device),
            block_table=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(num_seqs, dtype=torch.int32, device=self.device),
            decode_rows=None,
            prefill_rows=None,
            prefill=None,
        )

    @property
    def writes_kv_with_rotary(self) -> bool:
        # Every path here reads K/V from the cache; the fused op exists for CUDA tensors
        # (and writes the model's dtype: an FP8 cache is written by reshape_and_cache).
        from vllm import _custom_ops as ops

        fp8 = "fp8_kv_cache" in self.model_features
        return self.device.type == "cuda" and not fp8 and ops._fused_module() is not None

    def build_metadata(self, seqs: list[SeqLayout]) -> VarlenMetadata | TritonDecodeMetadata:
        if self.decode_kernel == "triton" and any(n == 1 for _, n, _ in seqs):
            return build_triton_decode_metadata(seqs, self.block_size, self.device, self.paged)
        return build_varlen_metadata(seqs, self.block_size, self.device, self.paged)

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_size)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_size)
        meta: VarlenMetadata | TritonDecodeMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if k is not None:  # None: written with the rotary embedding (writes_kv_with_rotary)
            # The metadata's slots come from block ids: none is padding.
            reshape_and_cache_torch(k, v, kv_cache, meta.slot_mapping, padded=False)
        extra = (sliding_window, logits_soft_cap, sinks)
        if isinstance(meta, VarlenMetadata):
            out = self._rows(q, kv_cache, meta, scale, *extra)
        else:
            from vllm.v1.attention.backends import triton_decode

            out = torch.empty_like(q)
            triton_decode.paged_decode_attention(
                q, kv_cache, meta.block_table, meta.seq_lens, scale, out=out,
                rows=meta.decode_rows, window=sliding_window or 0,
                soft_cap=logits_soft_cap or 0.0, sinks=sinks,
            )  # fmt: skip
            if meta.prefill is not None:
                rows = meta.prefill_rows  # (num_prefill_tokens,): q's rows, packed for varlen
                prefill = self._rows(q.index_select(0, rows), kv_cache, meta.prefill, scale, *extra)
                out.index_copy_(0, rows, prefill)
        if meta.both_ways:  # rows that see each other (images): attended again
            attend_chunks(out, q, kv_cache, meta.both_ways, scale, *extra)
        return out

    def _rows(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_size): meta's rows
        kv_cache: torch.Tensor,
        meta: VarlenMetadata,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of ``meta``'s rows: ``varlen_attn`` (its log-sum-exp scaling the rows
        of a layer with sinks), or the Triton prefill kernel where soft caps need it."""
        if logits_soft_cap is not None or (sinks is not None and not self.features.lse):
            from vllm.v1.attention.backends import triton_prefill

            return triton_prefill.paged_prefill_attention(
                q, kv_cache, meta.block_table, meta.seqused_k, meta.cu_seq_q, meta.max_q, scale,
                window=sliding_window or 0, soft_cap=logits_soft_cap or 0.0, sinks=sinks,
            )  # fmt: skip
        return self._varlen(q, kv_cache, meta, scale, sliding_window, sinks)

    def _varlen(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_size): meta's rows
        kv_cache: torch.Tensor,
        meta: VarlenMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``varlen_attn`` over ``meta``'s sequences, whose K/V are in the cache already
        (with ``sinks``: asked for its log-sum-exp, see ``sink_scaled``)."""
        kwargs = dict(self._kwargs)
        if self.features.causal == "is_causal":
            kwargs["is_causal"] = True
        elif sliding_window is not None:  # causal, the window's w - 1 positions to the left
            kwargs["window_size"] = (sliding_window - 1, 0)
        elif meta.max_q > 1:
            kwargs["window_size"] = (-1, 0)  # causal; a tuple: varlen_attn compares to one
        else:
            # Decodes only: each query is its context's last position, so causal is full
            # attention, and (-1, -1) lets the kernel fold GQA's query groups into rows.
            kwargs["window_size"] = (-1, -1)
        if self.features.scale:
            kwargs["scale"] = scale
        else:  # the kernel's own scale is head_size ** -0.5
            q = q * (scale * self.head_size**0.5)
        if meta.paged:
            keys, values = kv_cache.unbind(0)  # (num_blocks, block_size, kv_heads, dim) each
            kwargs.update(seqused_k=meta.seqused_k, block_table=meta.block_table)
        else:
            flat_k, flat_v = kv_cache.view(2, -1, *kv_cache.shape[3:]).unbind(0)
            keys = flat_k.index_select(0, meta.gather_slots)  # (total_k, kv_heads, dim)
            values = flat_v.index_select(0, meta.gather_slots)
            if keys.dtype != q.dtype:  # an FP8 cache: its values, exactly, in q's dtype
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            if not self.features.gqa and self.num_heads != self.num_kv_heads:
                group = self.num_heads // self.num_kv_heads
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
        if sinks is not None:
            from torch.nn.attention.varlen import AuxRequest  # where return_aux= exists

            kwargs["return_aux"] = AuxRequest(lse=True)
        out = self._attn(
            q, keys, values, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, **kwargs
        )
        if sinks is None:
            return out
        out, lse = out
        return sink_scaled(out, lse, sinks)
