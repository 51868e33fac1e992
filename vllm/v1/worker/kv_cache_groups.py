"""KV cache groups: the hybrid KV cache of models with sliding-window layers.

A layer that attends to a sliding window of ``w`` positions never reads a position
``w`` or more behind the token it computes. A model whose every layer kept every block
(gpt-oss: 12 of its 24 layers over 128 tokens; Gemma 3: five of six layers over 1,024;
Cohere 2: three of four) spends most of a long context's memory on K/V no layer reads.
vLLM's hybrid KV cache manager splits the layers into groups of one kind each (full
attention, or one window), gives every request a block table per group, and lets a
sliding group free the blocks its window has passed; the scheduler's side is
``KVCacheManager`` (``kv_cache_windows``).

The layout, as vLLM's: every group has the same number of layers ``G`` (the smallest
count of any kind of layer; a kind with more layers is split into several groups, the
last one short), and the cache is ``G`` tensors of the pool's size. Layer ``j`` of every
group uses tensor ``j``, so a block id names ``G`` per-layer blocks, which belong to
whichever group allocated the id. One pool serves every group: a short request spends
its blocks evenly, a long one mostly in the full-attention groups. A block costs ``G``
layers' worth of bytes instead of the model's ``num_layers``.

The runner builds each step's attention metadata once per group (``GroupedBuilder``)
and the model's layers each take their group's (``layer_metadata``). The CPU KV tier
copies a block id's bytes over the ``G`` tensors, whichever group holds it, and keys
it by group (``KVCacheManager``). A draft model caches its layers (its own tensors) at
the block ids of the first group, a full-attention one, which holds every position.
The hybrid cache is off (one group of every layer, every block kept, the windows
applied in attention only) with ``--disable-hybrid-kv-cache-manager``, and with a
draft model over a target whose every layer slides (no group holds every position).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.attention.backends.abstract import GroupedMetadata, SeqLayout


@dataclass(frozen=True)
class KVCacheGroups:
    """Which layers form which group, and which tensor each layer's cache is."""

    windows: tuple[int | None, ...]  # per group: None (full attention) or its window
    layer_group: tuple[int, ...]  # per layer: its group
    layer_tensor: tuple[int, ...]  # per layer: its cache tensor
    num_tensors: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Some group frees blocks behind a window, or there are several groups."""
        return self.windows != (None,)

    def describe(self) -> str:
        """E.g. ``2 groups of 12 layers: full attention, window 128``."""
        kinds = ["full attention" if w is None else f"window {w}" for w in self.windows]
        return f"{self.num_groups} group(s) of {self.num_tensors} layers: {', '.join(kinds)}"


def plan_kv_cache_groups(layer_windows: Sequence[int | None], hybrid: bool = True) -> KVCacheGroups:
    """The groups of a model whose layer ``i`` attends over ``layer_windows[i]`` (None:
    the whole context). ``hybrid`` False, or every layer full: one group of every layer,
    a tensor each (every block kept)."""
    n = len(layer_windows)
    if n == 0:
        raise ValueError("a model with no attention layers has no KV cache groups")
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))  # full first
    if not hybrid or kinds == [None]:
        return KVCacheGroups((None,), (0,) * n, tuple(range(n)), n)
    by_kind = {k: [i for i, w in enumerate(layer_windows) if w == k] for k in kinds}
    size = min(len(layers) for layers in by_kind.values())
    windows: list[int | None] = []
    layer_group = [0] * n
    layer_tensor = [0] * n
    for kind in kinds:
        layers = by_kind[kind]
        for start in range(0, len(layers), size):
            for j, layer in enumerate(layers[start : start + size]):
                layer_group[layer] = len(windows)
                layer_tensor[layer] = j
            windows.append(kind)
    return KVCacheGroups(tuple(windows), tuple(layer_group), tuple(layer_tensor), size)


class GroupedBuilder:
    """The step's metadata of every group, in place of the backend's own where the
    runner and its CUDA graphs ask for it (``build_metadata``, ``graph_metadata``). A
    sequence's block ids are a tuple of one list per group, or one list that serves every
    group (the profile runs and the graphs' padding rows: block 0)."""

    def __init__(self, backend: Any, groups: KVCacheGroups) -> None:
        self.backend = backend
        self.groups = groups

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def supports_decode_graphs(self) -> bool:
        return self.backend.supports_decode_graphs

    def build_metadata(self, seqs: list[SeqLayout]) -> GroupedMetadata:
        metas = []
        for g in range(self.groups.num_groups):
            group_seqs = [
                (start, n, ids[g] if isinstance(ids, tuple) else ids) for start, n, ids in seqs
            ]
            metas.append(self.backend.build_metadata(group_seqs))
        return GroupedMetadata(metas, self.groups.layer_group)

    def graph_metadata(self, num_seqs: int, max_blocks: int) -> GroupedMetadata:
        metas = [
            self.backend.graph_metadata(num_seqs, max_blocks) for _ in range(self.groups.num_groups)
        ]
        return GroupedMetadata(metas, self.groups.layer_group)
