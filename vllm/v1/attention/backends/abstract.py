"""The attention backend interface: a class per backend, one instance per model runner.

A backend is told the layer shapes once (heads, KV heads, head size, dtype, device, block
size), builds one metadata object per step from the batch layout, and attends for every
layer with it. Its classmethods say where it can run, so the selector
(``vllm.v1.attention.selector``) picks among the registered backends
(``backends/registry.py``) without knowing any of them by name.

One step, as the model runner drives it::

    meta = backend.build_metadata(seqs)            # once: (num_computed, num_new, block_ids)
    for each layer:                                # per request, in batch order
        out = backend.forward(q, k, v, kv_caches[layer], meta, scale)

``forward`` writes the step's K/V at ``meta``'s slot mapping and attends; ``meta`` is only
valid for the step it was built for (it holds that step's slots and block tables).

Two cache layouts per layer (``kv_cache_shape``), block ids always along dimension 1 (so
the CPU tier, sleep mode and the sizing treat both alike)::

    (2, num_blocks, block_size, kv_heads, head_size)   K and V cached apart
    (1, num_blocks, block_size, kv_heads, head_size)   latent: keys only (``value_size``)

The latent layout is multi-head latent attention's (DeepSeek's MLA): each token caches one
latent row, which is its key, and its value is the key's first ``value_size`` dims, so
storing a V half would hold the same numbers twice. A backend that reads it lists the
``latent_kv`` feature; its ``forward`` gets ``v`` None and returns ``value_size``-wide rows.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

# Per request, in batch order: (num_computed_tokens, num_new_tokens, block_ids). The new
# tokens are positions [num_computed, num_computed + num_new); block_ids cover them (a
# list, or the runner's ``BlockIds``, a list that also keeps them as a numpy array).
SeqLayout = tuple[int, int, Sequence[int]]


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, latent: bool
) -> tuple[int, int, int, int, int]:
    """One layer's KV cache shape (the module docstring): a K and a V half, or for a
    ``latent`` cache (values read from the keys) the K half alone."""
    return (1 if latent else 2, num_blocks, block_size, num_kv_heads, head_size)


def kv_cache_bytes(block_shape: tuple[int, ...], dtype: torch.dtype, num_tensors: int) -> int:
    """Bytes of one KV block over ``num_tensors`` cache tensors whose one-block shape is
    ``block_shape`` (``kv_cache_shape(1, ...)``), elements of ``dtype``."""
    return num_tensors * math.prod(block_shape) * torch.empty((), dtype=dtype).element_size()


def latent_value_size(arch: Any) -> int | None:
    """A model arch's ``latent_value_size``: set by an arch whose values are its keys'
    first dims (MLA: ``kv_lora_rank``), so its cache holds keys only; None (absent) for
    an arch whose K and V are cached apart."""
    return getattr(arch, "latent_value_size", None)


class BlockIds(list):
    """A request's KV block ids: a list, plus the same ids in an int64 numpy array grown
    with it (``array``), so that a backend builds a step's block table with numpy copies
    instead of converting every request's whole list every step (at 256 requests of 8k
    tokens that conversion was most of a decode step's host time). Grows by ``append`` and
    ``extend`` only (the runner's two mutations)."""

    __slots__ = ("_array",)

    def __init__(self, ids: Iterable[int] = ()) -> None:
        super().__init__(ids)
        self._array = np.empty(max(16, 2 * len(self)), dtype=np.int64)
        self._array[: len(self)] = self

    def extend(self, ids: Iterable[int]) -> None:
        ids = ids if isinstance(ids, list) else list(ids)
        if not ids:  # most steps give a request no new block
            return
        start = len(self)
        super().extend(ids)
        if len(self) > self._array.size:
            grown = np.empty(2 * len(self), dtype=np.int64)
            grown[:start] = self._array[:start]
            self._array = grown
        self._array[start : len(self)] = ids

    def append(self, block_id: int) -> None:
        self.extend((block_id,))

    @property
    def array(self) -> np.ndarray:
        """The ids as int64 (a view: valid until the next growth)."""
        return self._array[: len(self)]


class GroupedMetadata:
    """A step's metadata per KV cache group (the hybrid KV cache:
    ``vllm/v1/worker/kv_cache_groups.py``): ``groups[g]`` is the backend's metadata over
    group ``g``'s block tables, and ``layers[i]`` the one layer ``i`` attends with
    (``layer_metadata``). ``narrow`` and ``copy_`` act on every group, as a CUDA graph's
    buffers need."""

    __slots__ = ("groups", "layer_group", "layers")

    def __init__(self, groups: list[Any], layer_group: Sequence[int]) -> None:
        self.groups = groups
        self.layer_group = layer_group
        self.layers = [groups[g] for g in layer_group]

    def narrow(self, num_seqs: int) -> GroupedMetadata:
        return GroupedMetadata([m.narrow(num_seqs) for m in self.groups], self.layer_group)

    def copy_(self, src: GroupedMetadata) -> None:
        for dst, one in zip(self.groups, src.groups, strict=True):
            dst.copy_(one)


def layer_metadata(meta: Any, num_layers: int) -> list[Any]:
    """The metadata each of a model's ``num_layers`` layers attends with: its KV cache
    group's (``GroupedMetadata``), else the step's one for all."""
    if isinstance(meta, GroupedMetadata):
        if len(meta.layers) != num_layers:
            raise ValueError(f"metadata for {len(meta.layers)} layers, the model has {num_layers}")
        return meta.layers
    return [meta] * num_layers


def attend_both_ways(meta: Any, spans: list[tuple[int, int]]) -> None:
    """Make rows ``[a, b)`` of the step's flat batch attend to each other both ways (the
    ``bidirectional_spans`` feature), in every KV cache group's metadata
    (``GroupedMetadata``) or the step's one. Each span lies inside one prefill chunk (the
    scheduler never cuts one: ``SchedulerConfig.disable_chunked_mm_input``)."""
    for one in meta.groups if isinstance(meta, GroupedMetadata) else (meta,):
        one.attend_both_ways(spans)


def block_array(ids: Sequence[int]) -> np.ndarray:
    """``ids`` as an int64 numpy array: ``BlockIds``' own, else converted."""
    return ids.array if isinstance(ids, BlockIds) else np.asarray(ids, dtype=np.int64)


class AttentionBackend(ABC):
    """Paged attention over the KV cache layout ``(2, num_blocks, block_size, kv_heads,
    head_size)`` per layer, or the latent ``(1, ...)`` one (``value_size``, the module
    docstring).

    Subclasses set ``name`` (the ``VLLM_ATTENTION_BACKEND`` value), ``priority`` (the
    selector tries higher first; the universal fallback is 0), ``device_types`` and
    ``supported_dtypes``, and override the ``supports_*`` classmethods they restrict.
    ``decodes_first``: ``build_metadata`` needs the single-token decodes (one new token
    over a cached context) ahead of every prefill chunk; the runner orders the batch so.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    decodes_first: ClassVar[bool] = False
    device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.float32,
        torch.float16,
        torch.bfloat16,
    )
    # What a model's layers may ask of ``forward`` beyond plain causal attention, each a
    # keyword argument of it: ``sliding_window`` (the layer attends to its last N
    # positions), ``logits_soft_cap`` (scores become ``cap * tanh(s / cap)``) and
    # ``sinks`` (a (heads,) tensor of logits that join each softmax and are dropped);
    # and two of the cache, not keywords: ``fp8_kv_cache`` (``--kv-cache-dtype fp8``: the
    # KV cache holds FP8 values, which ``forward`` writes and reads) and ``latent_kv`` (the
    # cache holds keys only and values are their first ``value_size`` dims: MLA); and one
    # of the step's metadata: ``bidirectional_spans`` (``attend_both_ways``: rows of a
    # prefill chunk that see each other both ways, one image's tokens in Gemma 3), and
    # ``indexed_reads``: the model reads the cache through the step's metadata itself
    # (DeepSeek sparse attention's top-k rows, ``models/deepseek_dsa.py``).
    supported_features: ClassVar[frozenset[str]] = frozenset()
    # Features a model must use for the backend to serve it (a backend written for one
    # kind of model only: TRITON_MLA needs ``latent_kv``). The selector passes over the
    # backend, without a warning, for a model that lacks one.
    required_features: ClassVar[frozenset[str]] = frozenset()
    # The features the served model's layers use (set by the model runner after it builds
    # the backend): what ``warm_up`` compiles for.
    model_features: frozenset[str] = frozenset()

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        block_size: int,
        value_size: int | None = None,
    ) -> None:
        """``value_size``: None for a cache of K and V halves; for a latent cache (the
        ``latent_kv`` feature) the width of a value, the keys' first ``value_size`` dims."""
        if value_size is not None and not 0 < value_size <= head_size:
            raise ValueError(f"value_size={value_size}: 1 to head_size ({head_size})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.value_size = value_size

    @property
    def latent(self) -> bool:
        """The cache holds keys only; values are their first ``value_size`` dims."""
        return self.value_size is not None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """The shape of one layer's cache of ``num_blocks`` blocks that this backend reads."""
        return kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.latent
        )

    # -- where it runs (the selector asks before constructing) ----------------------------
    @classmethod
    def supports_device(cls, device: torch.device) -> bool:
        return device.type in cls.device_types

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        return True

    @classmethod
    def validate_configuration(
        cls, device: torch.device, dtype: torch.dtype, block_size: int, head_size: int
    ) -> list[str]:
        """Why the backend cannot run with these settings; empty when it can. Subclasses
        append costlier checks (an import) only when these cheap ones pass."""
        reasons = []
        if not cls.supports_device(device):
            needs = " or ".join(t.upper() for t in cls.device_types)
            reasons.append(f"device is {device.type}, {cls.name} needs {needs}")
        if not cls.supports_dtype(dtype):
            names = ", ".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            reasons.append(f"dtype {dtype} ({cls.name} supports {names})")
        if not cls.supports_head_size(head_size):
            reasons.append(f"head size {head_size} is not supported by {cls.name}")
        if not cls.supports_block_size(block_size):
            reasons.append(f"block size {block_size} is not supported by {cls.name}")
        return reasons

    @classmethod
    def unsupported_features(cls, features: frozenset[str]) -> list[str]:
        """Why the backend cannot attend for a model whose layers need ``features`` (see
        ``supported_features``); empty when it can."""
        return [
            f"{name.replace('_', ' ')} attention is not supported by {cls.name}"
            for name in sorted(features - cls.supported_features)
        ]

    # -- per model --------------------------------------------------------------------------
    def use_prefill_dtype(self, dtype: torch.dtype | None) -> None:
        """The model's prefill GEMMs compute in ``dtype`` (None: the model's own dtype); a
        backend may take its prefill products in it too. Called at every (re)install."""

    @property
    def detail(self) -> str:
        """How this instance runs, for the start-up log ('' when nothing to add)."""
        return ""

    # -- CUDA graphs (vllm/v1/worker/cuda_graph.py) ------------------------------------------
    @property
    def supports_decode_graphs(self) -> bool:
        """A decode-only step (every sequence one new token) of this instance can be
        captured in a CUDA graph and replayed: its forward reads no device value on the
        host, its kernels' launch shapes depend on the number of sequences only, and
        ``graph_metadata`` gives the buffers to replay with."""
        return False

    def graph_metadata(self, num_seqs: int, max_blocks: int) -> Any:
        """Metadata of a decode-only step of ``num_seqs`` sequences whose tensors stay put:
        a graph captured with it replays any such step whose metadata (from
        ``build_metadata``) is copied in with ``.copy_``, with block tables up to
        ``max_blocks`` wide; ``.narrow(n)`` is the same for the first ``n`` sequences, as
        views (one set of buffers serves every captured batch size). Every sequence starts
        as padding: one token at slot 0 (the null block, which no sequence reads)."""
        raise NotImplementedError(f"{self.name} does not capture decode steps in CUDA graphs")

    def warm_up(self, kv_caches: list[torch.Tensor], max_num_seqs: int) -> int:
        """Compile at start-up the kernels a step would otherwise compile on first use
        (kernels specialised per launch configuration), on the real cache; the launches
        made (0: nothing to compile)."""
        return 0

    @property
    def writes_kv_with_rotary(self) -> bool:
        """The model may write this step's K/V into the cache itself, with the rotary
        embedding (``ops.rotary_embedding_and_cache``, one kernel), and call ``forward``
        with ``k`` and ``v`` None: the backend reads K/V from the cache only, at
        ``meta.slot_mapping``'s slots (every slot >= 0)."""
        return False

    # -- per step ---------------------------------------------------------------------------
    @abstractmethod
    def build_metadata(self, seqs: list[SeqLayout]) -> Any:
        """The step's metadata (slot mapping, block tables, query offsets...) on
        ``self.device``, built once and shared by every layer. Mutates nothing."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_size)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_size)
        v: torch.Tensor | None,  # None for a latent cache
        kv_cache: torch.Tensor,  # (2 or 1, num_blocks, block_size, num_kv_heads, head_size)
        meta: Any,
        scale: float,
        **features: Any,
    ) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache`` at ``meta``'s slots (the only mutation;
        none when ``k`` and ``v`` are None, see ``writes_kv_with_rotary``), then attend
        each token over its request's context up to itself; returns
        ``(num_tokens, num_heads, head_size)``, or ``value_size`` wide for a latent cache
        (``v`` None: the values are the keys' first dims). ``features``: the layer's keyword
        arguments among ``supported_features`` (only a backend that supports them is
        installed for a model that passes them)."""
