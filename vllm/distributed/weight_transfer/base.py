"""RL weight sync, the part both sides share: what a round sends and how it is laid out.

A trainer (rank 0 of a torch.distributed group it opens with the engine) pushes a full set
of checkpoint tensors into a running engine, vLLM's weight-transfer protocol:

    trainer                                   engine (HTTP routes, LLM or AsyncLLM)
    trainer_init  ----- init_info ----------> init_weight_transfer_engine  (rendezvous)
    send_weights  ----------------------------> start_weight_update
                  ----- update_info --------> update_weights   } at the same time: the
                  ===== tensors (broadcast) ==>                 } engine receives them
                  ----------------------------> finish_weight_update(weight_version)

``update_info`` names each tensor (``names``, ``dtype_names``, ``shapes``: vLLM's keys); the
tensors follow in that order. Packed (the default), consecutive tensors travel together in
byte buffers of at most ``packed_buffer_size_bytes`` (a larger tensor alone in its own),
each tensor at a 64-byte-aligned offset; both sides cut the buffers from the metadata alone
(``pack_plan``), so nothing else is sent. Unpacked, each tensor is one broadcast. Either way
the bytes travel as uint8, so every dtype goes through gloo and NCCL alike.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's: 1 GiB
DEFAULT_PACKED_NUM_BUFFERS = 2  # broadcasts in flight at once (vLLM's default)
DEFAULT_TIMEOUT_S = 300.0  # rendezvous and each collective
_ALIGN = 64


@dataclass(frozen=True)
class ParamMeta:
    """One tensor of a round: its checkpoint name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


class WeightSource(ABC):
    """What a trainer sends each round: ``metadata()`` and then, in the same order, the
    tensors (``__iter__``). A subclass may gather shards (FSDP) as it iterates."""

    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    @abstractmethod
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class ModuleSource(WeightSource):
    """A ``torch.nn.Module``'s parameters under their own names (a transformers model's
    are its checkpoint's); tied parameters once. A DTensor is gathered (``full_tensor``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self.module.named_parameters()
        ]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.module.named_parameters():
            full = getattr(p, "full_tensor", None)
            yield name, (full() if callable(full) else p).detach()


def dtype_from_name(name: Any, where: str) -> torch.dtype:
    """``torch.<name>`` for a dtype name ("bfloat16", "float32"...); ``ValueError`` else."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: {name!r} is not a torch dtype name (e.g. 'bfloat16')")
    return dtype


def parse_update_info(update_info: Any) -> list[ParamMeta]:
    """vLLM's ``update_info`` (``names``, ``dtype_names``, ``shapes``, equally long) as the
    round's tensors; ``ValueError`` naming the key that is wrong."""
    if not isinstance(update_info, dict):
        raise ValueError(f"update_info must be a JSON object, got {type(update_info).__name__}")
    keys = ("names", "dtype_names", "shapes")
    unknown = sorted(set(update_info) - set(keys))
    if unknown:
        raise ValueError(f"update_info has keys this engine does not take: {unknown}")
    missing = [k for k in keys if k not in update_info]
    if missing:
        raise ValueError(f"update_info lacks {missing}")
    names, dtypes, shapes = (update_info[k] for k in keys)
    for key, value in zip(keys, (names, dtypes, shapes), strict=True):
        if not isinstance(value, list):
            raise ValueError(f"update_info.{key} must be a list")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"update_info's lists differ in length: {len(names)} names, {len(dtypes)} "
            f"dtype_names, {len(shapes)} shapes"
        )
    metas = []
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"update_info.names[{i}] must be a non-empty string")
        ok = isinstance(shape, list) and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        )
        if not ok:
            raise ValueError(f"update_info.shapes[{i}] must be a list of sizes >= 0")
        metas.append(ParamMeta(name, dtype_from_name(dtype, f"update_info.dtype_names[{i}]"),
                               tuple(shape)))  # fmt: skip
    if len({m.name for m in metas}) != len(metas):
        raise ValueError("update_info.names has a name twice")
    return metas


def update_info_of(metas: Sequence[ParamMeta]) -> dict[str, list]:
    """The ``update_info`` a trainer sends for ``metas`` (``parse_update_info``'s inverse)."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [str(m.dtype).removeprefix("torch.") for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


@dataclass(frozen=True)
class PackedBuffer:
    """One broadcast of a packed round: ``entries`` (index into the round, byte offset)."""

    entries: tuple[tuple[int, int], ...]
    nbytes: int


def pack_plan(metas: Sequence[ParamMeta], buffer_bytes: int) -> list[PackedBuffer]:
    """The round's buffers: consecutive tensors while they fit in ``buffer_bytes``, each at
    a 64-byte-aligned offset (so a byte slice can be viewed as its dtype); a tensor larger
    than a buffer travels alone. Both sides compute the same plan from the metadata."""
    plan: list[PackedBuffer] = []
    entries: list[tuple[int, int]] = []
    end = 0
    for i, meta in enumerate(metas):
        offset = -(-end // _ALIGN) * _ALIGN
        if entries and offset + meta.nbytes > buffer_bytes:
            plan.append(PackedBuffer(tuple(entries), end))
            entries, offset = [], 0
        entries.append((i, offset))
        end = offset + meta.nbytes
    if entries:
        plan.append(PackedBuffer(tuple(entries), end))
    return plan


@dataclass(frozen=True)
class WeightTransferInitInfo:
    """The engine's side of the rendezvous (vLLM's ``init_info`` keys): the trainer's store
    at ``master_address:master_port``, this engine's rank ``rank_offset`` in a group of
    ``world_size``, and the wire parameters the trainer chose. ``timeout_s`` (ours) bounds
    the rendezvous and each broadcast."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def parse(cls, init_info: Any) -> WeightTransferInitInfo:
        """From the request's JSON object; ``ValueError`` naming a wrong or unknown key."""
        if not isinstance(init_info, dict):
            raise ValueError(f"init_info must be a JSON object, got {type(init_info).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(init_info) - set(known))
        if unknown:
            raise ValueError(
                f"init_info has keys this engine does not take: {unknown} (it takes {known}; "
                "vLLM's nccl_unique_id_b64 rendezvous is not built here)"
            )
        missing = [f.name for f in fields(cls)[:4] if f.name not in init_info]
        if missing:
            raise ValueError(f"init_info lacks {missing}")
        info = cls(**init_info)
        info.check()
        return info

    def check(self) -> None:
        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("init_info.master_address must be a host name or address")
        if not integer(self.master_port) or not 0 < self.master_port < 65536:
            raise ValueError(f"init_info.master_port must be a port, got {self.master_port!r}")
        if not integer(self.world_size) or self.world_size < 2:
            raise ValueError(f"init_info.world_size must be >= 2, got {self.world_size!r}")
        if not integer(self.rank_offset) or not 0 < self.rank_offset < self.world_size:
            raise ValueError(
                f"init_info.rank_offset must be in 1..world_size-1 (rank 0 is the trainer), "
                f"got {self.rank_offset!r}"
            )
        if not isinstance(self.packed, bool):
            raise ValueError("init_info.packed must be true or false")
        for key in ("packed_buffer_size_bytes", "packed_num_buffers"):
            value = getattr(self, key)
            if not integer(value) or value < 1:
                raise ValueError(f"init_info.{key} must be an integer >= 1, got {value!r}")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"init_info.timeout_s must be > 0, got {timeout!r}")
