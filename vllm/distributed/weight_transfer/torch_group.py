"""The transport: a torch.distributed process group of its own (gloo for CPU tensors,
NCCL for CUDA tensors) between the trainer (rank 0, which hosts the rendezvous store) and
the engine. The group is built from a ``TCPStore`` directly, so neither side's default
process group (a trainer's FSDP group) is touched."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from vllm.distributed.weight_transfer.base import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    ParamMeta,
    WeightSource,
    WeightTransferInitInfo,
    pack_plan,
    update_info_of,
)

logger = logging.getLogger(__name__)

_STORE_PREFIX = "vllm_weight_transfer/"


def open_group(
    backend: str,
    address: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    device: torch.device | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) the rendezvous at ``address:port`` and return the group; blocks
    until all ``world_size`` ranks have joined, or raises after ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(_STORE_PREFIX, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        if device is None or device.type != "cuda":
            raise ValueError("the nccl weight-transfer backend moves CUDA tensors: use gloo")
        if device.index is not None:
            torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"weight-transfer backend must be gloo or nccl, got {backend!r}")


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class _Window:
    """At most ``size`` broadcasts in flight: ``push`` waits for the oldest beyond that and
    hands its buffer to ``done`` (the receiver unpacks there)."""

    def __init__(self, size: int, done: Callable[[Any], None] | None = None) -> None:
        self.size, self.done = size, done
        self.pending: deque[tuple[Any, Any]] = deque()

    def push(self, work: Any, item: Any) -> None:
        self.pending.append((work, item))
        while len(self.pending) >= self.size:
            self._finish_one()

    def drain(self) -> None:
        while self.pending:
            self._finish_one()

    def _finish_one(self) -> None:
        work, item = self.pending.popleft()
        work.wait()
        if self.done is not None:
            self.done(item)


def send_tensors(
    group: dist.ProcessGroup,
    metas: Sequence[ParamMeta],
    tensors: Iterator[torch.Tensor],
    device: torch.device,
    packed: bool,
    buffer_bytes: int,
    num_buffers: int,
) -> None:
    """Broadcast (as rank 0) ``tensors``, which match ``metas`` in order, from ``device``."""
    window = _Window(num_buffers)
    if not packed:
        for tensor in tensors:
            data = _as_bytes(tensor.to(device))
            window.push(_broadcast(group, data), data)
        window.drain()
        return
    plan = pack_plan(metas, buffer_bytes)
    for buffer in plan:
        data = torch.empty(buffer.nbytes, dtype=torch.uint8, device=device)
        for index, offset in buffer.entries:
            size = metas[index].nbytes
            data[offset : offset + size].copy_(_as_bytes(next(tensors).to(device)))
        window.push(_broadcast(group, data), data)
    window.drain()


def receive_tensors(
    group: dist.ProcessGroup,
    metas: Sequence[ParamMeta],
    device: torch.device,
    packed: bool,
    buffer_bytes: int,
    num_buffers: int,
    into: Callable[[str, torch.Tensor], None],
) -> None:
    """Receive the tensors of ``metas`` (sent by ``send_tensors``) on ``device``; each goes
    to ``into(name, tensor)`` as its broadcast lands (a view of a buffer no one else uses:
    it keeps the buffer alive)."""
    if not packed:

        def unpack_one(item: tuple[ParamMeta, torch.Tensor]) -> None:
            meta, data = item
            into(meta.name, data.view(meta.dtype).view(meta.shape))

        window = _Window(num_buffers, unpack_one)
        for meta in metas:
            data = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
            window.push(_broadcast(group, data), (meta, data))
        window.drain()
        return

    def unpack(item: tuple[Any, torch.Tensor]) -> None:
        buffer, data = item  # a buffer of its own: its views stay valid, no copy needed
        for index, offset in buffer.entries:
            meta = metas[index]
            into(meta.name, data[offset : offset + meta.nbytes].view(meta.dtype).view(meta.shape))

    window = _Window(num_buffers, unpack)
    for buffer in pack_plan(metas, buffer_bytes):
        data = torch.empty(buffer.nbytes, dtype=torch.uint8, device=device)
        window.push(_broadcast(group, data), (buffer, data))
    window.drain()


class VLLMWeightSyncClient(Protocol):
    """The engine's control calls, as a trainer makes them (over HTTP, or in process)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...

    def shutdown_weight_transfer_engine(self) -> None: ...


@dataclass(frozen=True)
class TrainerInitInfo:
    """The trainer's side (vLLM's ``NCCLTrainerInitInfo`` keys): the store it hosts at
    ``master_address:master_port``, the group's ``world_size`` (the trainer and one rank per
    engine: 2 for one engine, 1 + N for a server with ``-dp N``, which ``GET
    /get_world_size`` answers), and the wire parameters, which it passes on to the
    engines."""

    backend: ClassVar[str]
    master_address: str
    master_port: int
    world_size: int = 2
    packed: bool = True
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = DEFAULT_TIMEOUT_S

    def engine_init_info(self) -> WeightTransferInitInfo:
        info = WeightTransferInitInfo(
            self.master_address, self.master_port, 1, self.world_size, self.packed,
            self.packed_buffer_size_bytes, self.packed_num_buffers, self.timeout_s,
        )  # fmt: skip
        info.check()
        return info


@dataclass(frozen=True)
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "gloo"


@dataclass(frozen=True)
class NCCLTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "nccl"


class TorchGroupTrainer:
    """The trainer's end: ``trainer_init`` opens the group with the engine (the engine's
    ``init_weight_transfer_engine`` runs at the same time), ``send_weights`` runs a whole
    round from ``source``, broadcast to every engine of the group (``world_size`` - 1 of
    them: one server's data-parallel engines); they must serve the same backend
    (``--weight-transfer-config``)."""

    init_info_cls: ClassVar[type[TrainerInitInfo]] = TrainerInitInfo

    def __init__(
        self,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        init_info: TrainerInitInfo,
        group: dist.ProcessGroup,
    ) -> None:
        self.client, self.source, self.init_info, self.group = client, source, init_info, group
        nccl = init_info.backend == "nccl"  # sends from the trainer's current CUDA device
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else (
            torch.device("cpu")
        )  # fmt: skip

    @classmethod
    def trainer_init(
        cls, init_info: TrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource
    ) -> TorchGroupTrainer:
        if not isinstance(init_info, cls.init_info_cls):
            raise ValueError(f"{cls.__name__} takes a {cls.init_info_cls.__name__}")
        if init_info.world_size < 2:
            raise ValueError("world_size must be >= 2: the trainer's rank and the engines'")
        payload = vars(init_info.engine_init_info()).copy()
        nccl = init_info.backend == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        with ThreadPoolExecutor(1) as pool:  # the engine blocks in its rendezvous meanwhile
            future = pool.submit(client.init_weight_transfer_engine, payload)
            try:
                group = open_group(
                    init_info.backend, init_info.master_address, init_info.master_port, 0,
                    init_info.world_size, init_info.timeout_s, device,
                )  # fmt: skip
            except BaseException:
                if future.done():
                    future.result()  # the engine's refusal says more than our timeout
                raise
            future.result()
        logger.info("Weight transfer group open (%s)", init_info.backend)
        return cls(client, source, init_info, group)

    def send_weights(self, weight_version: str | None = None) -> None:
        """One round: start, update (the engine receives while this broadcasts), finish
        (with ``weight_version``, the engine's new version, if given)."""
        metas = self.source.metadata()
        info = self.init_info
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(1)
        try:
            future = pool.submit(self.client.update_weights, update_info_of(metas))
            send_tensors(
                self.group, metas, self._checked(metas), self.device, info.packed,
                info.packed_buffer_size_bytes, info.packed_num_buffers,
            )  # fmt: skip
            future.result()
        finally:
            pool.shutdown(wait=False)  # a failed broadcast leaves the engine's call waiting
        self.client.finish_weight_update(weight_version)

    def _checked(self, metas: list[ParamMeta]) -> Iterator[torch.Tensor]:
        """The source's tensors, each checked against what the engine was told to expect
        (a mismatch would split the byte stream differently on the two sides)."""
        count = 0
        for name, tensor in self.source:
            if count >= len(metas):
                raise ValueError(f"the source yielded more tensors than its metadata ({name!r})")
            meta = metas[count]
            if (name, tensor.dtype, tuple(tensor.shape)) != (meta.name, meta.dtype, meta.shape):
                raise ValueError(
                    f"the source's tensor {count} is {name!r} {tensor.dtype} "
                    f"{tuple(tensor.shape)}; its metadata said {meta.name!r} {meta.dtype} "
                    f"{meta.shape}"
                )
            count += 1
            yield tensor
        if count != len(metas):
            raise ValueError(f"the source yielded {count} tensors of {len(metas)}")

    def shutdown(self) -> None:
        """Leave the group (the engine's side: ``shutdown_weight_transfer_engine``)."""
        group, self.group = self.group, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()


class GlooTrainerWeightTransferEngine(TorchGroupTrainer):
    init_info_cls = GlooTrainerInitInfo


class NCCLTrainerWeightTransferEngine(TorchGroupTrainer):
    init_info_cls = NCCLTrainerInitInfo
