"""The runner's side of the CPU KV tier: the tier's tensors and the block copies.

The tier mirrors the KV cache's layout, one tensor per layer of shape
``[2, num_cpu_blocks, block_size, num_kv_heads, head_size]`` (``[1, ...]`` for a latent
cache, keys only: MLA), so a block is two contiguous chunks (K and V), or one, per layer
on both sides. Copies are grouped into runs of
consecutive block ids on both sides, one ``copy_`` per run, layer and K/V: a request's
blocks are mostly consecutive, so a context moves in a few large copies.

A plan whose copies are scattered on the device side (a reloaded context lands in
whatever blocks the pool hands out) would be one small copy per block, layer and K/V: on
an H200 a 32k-token context's 131k copies of 32 KiB took 1.52 s against 78 ms in runs,
as long as recomputing it. Such a plan is *staged* on CUDA: the pairs are ordered by
their host block, so the host side moves in a few large copies between the tier and a
device staging buffer, and one ``index_copy_`` / ``index_select`` per layer and K/V
scatters or gathers the device side. The two halves run on two streams over two
buffers, so that each layer's indexed copy overlaps the next one's transfer over the
host link (staged on one stream, a 32k-token load took 88 ms on the H200 against 78 ms
for the same bytes in runs).

On CPU the tier is plain memory and a copy is a memcpy, done before the forward pass.
On CUDA the tier is page-locked (pinned) in the background (``BackgroundPinner``): the
engine starts at once and the tier works from the first step, its copies at the pageable
rate until pinning ends (locking 62 GiB took 66 s on an H200 VM, which an allocation
with ``pin_memory=True`` used to spend before the engine could start). The copies run on a
side stream with ``non_blocking=True``; the side stream first waits for the compute
stream (the blocks saved were written by the previous forward) and the compute stream
then waits for the side stream (this forward reads the loaded blocks and overwrites the
saved ones). The host never touches the tier's memory, so no host synchronisation is
needed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from vllm.v1.core.sched.output import KVOffloadTransfers

logger = logging.getLogger(__name__)

# (source start, destination start, number of blocks)
Run = tuple[int, int, int]

# A plan is staged when its pairs fall into at least this many runs and into at least
# STAGE_FACTOR times as many as its host side alone does.
STAGE_MIN_RUNS = 8
STAGE_FACTOR = 4
# Blocks staged at a time, per layer and K/V (32 MiB on Llama-3-8B: 16 tokens x 8 heads
# x 128 x bf16 a block).
STAGE_BLOCKS = 1024


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


# (register(address, bytes), unregister(address)): page-locking host memory for a device.
HostRegister = tuple[Callable[[int, int], None], Callable[[int], None]]


def cuda_host_register(device: torch.device) -> HostRegister:
    """cudaHostRegister / cudaHostUnregister through torch's bindings (which release the
    GIL while the driver locks the pages), portable across contexts; RuntimeError on a
    CUDA error."""
    cudart = torch.cuda.cudart()
    portable = 1  # cudaHostRegisterPortable

    def check(err, what: str) -> None:
        if err != cudart.cudaError.success:
            raise RuntimeError(f"{what}: {cudart.cudaGetErrorString(err)}")

    def register(address: int, size: int) -> None:
        with torch.cuda.device(device):
            check(cudart.cudaHostRegister(address, size, portable), "cudaHostRegister")

    def unregister(address: int) -> None:
        check(cudart.cudaHostUnregister(address), "cudaHostUnregister")

    return register, unregister


class BackgroundPinner:
    """Page-locks ``tensors`` one at a time on a thread of its own, so that a large tier
    costs the engine's start-up nothing. Copies to and from a tensor not yet locked are
    correct (the driver stages pageable memory), only slower. ``close`` stops it and
    unlocks what it locked, before the tensors are freed. A failure is logged and leaves
    the rest pageable."""

    def __init__(self, tensors: Sequence[torch.Tensor], host_register: HostRegister) -> None:
        self._tensors = list(tensors)
        self._register, self._unregister = host_register
        self.locked: list[int] = []  # addresses, in order
        self.done = threading.Event()
        self.error: Exception | None = None
        self.seconds: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-tier-pinner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        start = time.monotonic()
        try:
            for tensor in self._tensors:
                if self._stop.is_set():
                    return
                self._register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
                self.locked.append(tensor.data_ptr())
            self.seconds = time.monotonic() - start
            logger.info(
                "CPU KV tier: %.2f GiB page-locked in %.1f s, in the background",
                sum(t.numel() * t.element_size() for t in self._tensors) / 2**30,
                self.seconds,
            )
        except Exception as e:  # the tier still works from pageable memory
            self.error = e
            logger.warning("CPU KV tier: page-locking stopped (%s); its copies stay slower", e)
        finally:
            self.done.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for address in self.locked:
            try:
                self._unregister(address)
            except Exception as e:  # noqa: BLE001 - the others must still be unlocked
                logger.warning("CPU KV tier: unlocking failed: %s", e)
        self.locked = []


class CPUOffloadingHandler:
    """The ``native`` backend: ``num_blocks`` KV blocks per layer in host memory.

    ``transfer`` mutates the tier's tensors (saves) and the KV cache's (loads); it must
    run before the forward pass of the step whose ``SchedulerOutput`` carried the plan.
    ``close`` before the tier's tensors go (the runner's ``release``).
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        num_blocks: int,
        staged: bool | None = None,
        host_register: HostRegister | None = None,
    ) -> None:
        """``staged``: stage scattered plans (module docstring); None: on CUDA only.
        ``host_register``: how the tier's memory is page-locked in the background; None:
        CUDA's on a CUDA cache, nothing on a CPU one."""
        if not kv_caches:
            raise ValueError("initialize the KV cache before the CPU tier")
        self.gpu_caches = list(kv_caches)
        self.num_blocks = num_blocks
        device = self.gpu_caches[0].device
        self.stream: torch.cuda.Stream | None = None
        self.index_stream: torch.cuda.Stream | None = None  # staged copies' indexed half
        self.streams = StagingStreams()
        if device.type == "cuda" and torch.cuda.is_available():
            self.stream = torch.cuda.Stream(device=device)
            self.index_stream = torch.cuda.Stream(device=device)
            if host_register is None:
                try:
                    host_register = cuda_host_register(device)
                except Exception as e:  # noqa: BLE001 - a pageable tier still works
                    logger.warning("CPU KV tier: cannot page-lock host memory here: %s", e)
        # Plain host memory: the OS maps its pages as they are first touched (or locked).
        self.cpu_caches = [
            torch.empty((layer.shape[0], num_blocks, *layer.shape[2:]), dtype=layer.dtype)
            for layer in self.gpu_caches
        ]
        self.pinner: BackgroundPinner | None = None
        self._unpin: weakref.finalize | None = None
        if host_register is not None:
            self.pinner = BackgroundPinner(self.cpu_caches, host_register)
            # Unlocked before the tensors are freed, also when the handler is just dropped.
            self._unpin = weakref.finalize(self, _unpin, self.stream, self.pinner)
        self.block_bytes = sum(t[:, 0].numel() * t.element_size() for t in self.cpu_caches)
        self.staged = self.stream is not None if staged is None else staged

    def close(self) -> None:
        """Stop page-locking and unlock the tier (its tensors may then be freed)."""
        if self._unpin is not None:
            self._unpin()  # once: a finalizer runs at most one time

    @property
    def size_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def synchronize(self) -> None:
        """Wait for this handler's copies in flight (CUDA; nothing on the CPU)."""
        if self.stream is not None:
            self.stream.synchronize()

    def block_views(self, ids: Sequence[int]) -> tuple[list[int], list[torch.Tensor]]:
        """These tier blocks as contiguous views, no copy, for a remote reader
        (``vllm.distributed.kv_transfer``): the run lengths of ``ids`` (consecutive ids
        form one run), and for each layer, K/V and run, in that order, the run's
        ``[length, block_size, heads, head_size]`` view. The caller holds the blocks (no save
        overwrites them) while it reads; a save still in flight into them is waited for."""
        self.synchronize()
        runs = host_runs(ids)
        views = [
            cache[kv, start : start + n]
            for cache in self.cpu_caches
            for kv in range(cache.shape[0])
            for start, _, n in runs
        ]
        return [n for _, _, n in runs], views

    def write_runs(
        self,
        copies: Sequence[tuple[int, int, int, int]],
        chunks: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        """Fill tier blocks from ``chunks``: for each layer and K/V (``block_views``'
        order) a list of ``[rows, block_size, heads, head_size]`` tensors. Each copy
        ``(chunk, row, block, n)`` moves rows ``[row, row + n)`` of that chunk into tier
        blocks ``[block, block + n)``, for every layer and K/V: one memcpy each. The
        blocks must not be in a copy in flight (the caller just allocated them)."""
        self.synchronize()
        targets = [cache[kv] for cache in self.cpu_caches for kv in range(cache.shape[0])]
        if len(chunks) != len(targets):
            raise ValueError(f"{len(chunks)} chunks for a tier of {len(targets)} layers x K/V")
        for target, parts in zip(targets, chunks, strict=True):
            for part, row, block, n in copies:
                target[block : block + n].copy_(parts[part][row : row + n])

    def layouts(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """One block's shape and dtype, for each layer and K/V (``block_views``' order)."""
        return [(tuple(t.shape[2:]), t.dtype) for t in self.cpu_caches for _ in range(t.shape[0])]

    def transfer(self, plan: KVOffloadTransfers) -> None:
        """Run every save, then every load (the plan's contract)."""
        if self.stream is None:
            self._copy(plan.saves, save=True, non_blocking=False)
            self._copy(plan.loads, save=False, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(plan.saves, save=True, non_blocking=True)
            self._copy(plan.loads, save=False, non_blocking=True)
        compute.wait_stream(self.stream)

    def _copy(self, pairs: Sequence[tuple[int, int]], save: bool, non_blocking: bool) -> None:
        """Saves: (device block, tier block) pairs; loads: (tier block, device block)."""
        src_caches, dst_caches = (
            (self.gpu_caches, self.cpu_caches) if save else (self.cpu_caches, self.gpu_caches)
        )
        runs = copy_runs(pairs)
        if self.staged and len(runs) >= STAGE_MIN_RUNS:
            host = 1 if save else 0  # the host block's place in a pair
            by_host = sorted(pairs, key=lambda p: p[host])
            if STAGE_FACTOR * len(host_runs([p[host] for p in by_host])) <= len(runs):
                self._staged_copy(by_host, save, non_blocking)
                return
        for s0, d0, n in runs:
            for src, dst in zip(src_caches, dst_caches, strict=True):
                for kv in range(src.shape[0]):  # K and V: each run is contiguous in both
                    dst[kv, d0 : d0 + n].copy_(src[kv, s0 : s0 + n], non_blocking=non_blocking)

    def _staged_copy(self, pairs: list[tuple[int, int]], save: bool, non_blocking: bool) -> None:
        """``pairs`` ordered by host block, STAGE_BLOCKS at a time: the host side's runs
        move between the tier and a staging buffer on the device, which one indexed copy
        per layer and K/V scatters into (loads) or gathers from (saves) the KV cache.

        A pipeline of two stages over (chunk, layer, K/V) units and two staging buffers:
        the host copies run on the tier's stream and the indexed copies on a second one,
        so unit u's scatter (or gather) overlaps unit u+1's transfer over the host link.
        Each buffer's next producer waits for its last consumer (an event), each
        consumer for its producer, and the tier's stream ends waiting for both."""
        device = self.gpu_caches[0].device
        streams, copy_stream, index_stream = self.streams, self.stream, self.index_stream
        producer, consumer = (index_stream, copy_stream) if save else (copy_stream, index_stream)
        streams.wait(index_stream, streams.record(copy_stream))  # after the compute stream
        buffers: dict[tuple, list[torch.Tensor]] = {}  # two per (block shape, dtype)
        freed: list[object] = [None, None]  # per buffer: its last consumer's event
        # The chunks' device ids and the buffers live until this returns, after the tier's
        # stream waits for the indexed copies: no later allocation reuses them early.
        kept: list[torch.Tensor] = []
        unit = 0
        for c in range(0, len(pairs), STAGE_BLOCKS):
            chunk = pairs[c : c + STAGE_BLOCKS]
            runs = host_runs([p[1] if save else p[0] for p in chunk])
            ids = self._device_ids([p[0] if save else p[1] for p in chunk], index_stream)
            kept.append(ids)
            for cache, tier in zip(self.gpu_caches, self.cpu_caches, strict=True):
                key = (tuple(cache.shape[2:]), cache.dtype)
                if key not in buffers:
                    size = (min(STAGE_BLOCKS, len(pairs)), *cache.shape[2:])
                    buffers[key] = [
                        torch.empty(size, dtype=cache.dtype, device=device) for _ in "ab"
                    ]
                for kv in range(cache.shape[0]):
                    b = unit % 2
                    staging = buffers[key][b][: len(chunk)]
                    host = _host_copies(tier[kv], staging, runs, save, non_blocking)
                    index = _indexed_copy(cache[kv], staging, ids, save)
                    produce, consume = (index, host) if save else (host, index)
                    streams.wait(producer, freed[b])
                    streams.run(producer, produce)
                    streams.wait(consumer, streams.record(producer))
                    streams.run(consumer, consume)
                    freed[b] = streams.record(consumer)
                    unit += 1
        streams.wait(copy_stream, streams.record(index_stream))

    def _device_ids(self, ids: list[int], stream: object) -> torch.Tensor:
        """``ids`` on the cache's device, uploaded on ``stream`` (from pinned memory on
        CUDA: no host sync)."""
        host = torch.tensor(ids)
        device = self.gpu_caches[0].device
        if device.type != "cuda":
            return host
        out: list[torch.Tensor] = []
        self.streams.run(
            stream, lambda: out.append(host.pin_memory().to(device, non_blocking=True))
        )
        return out[0]


def _host_copies(
    tier: torch.Tensor, staging: torch.Tensor, runs: list[Run], save: bool, non_blocking: bool
) -> Callable[[], None]:
    """The copies between one layer's K or V in the tier and the staging buffer."""

    def run() -> None:
        for h0, at, n in runs:
            if save:
                tier[h0 : h0 + n].copy_(staging[at : at + n], non_blocking=non_blocking)
            else:
                staging[at : at + n].copy_(tier[h0 : h0 + n], non_blocking=non_blocking)

    return run


def _indexed_copy(
    cache: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor, save: bool
) -> Callable[[], None]:
    """The gather from (saves) or the scatter into (loads) one layer's K or V blocks (an
    FP8 cache's as bytes: torch has no ``index_copy_`` for FP8 types)."""
    if cache.element_size() == 1:
        cache, staging = cache.view(torch.uint8), staging.view(torch.uint8)
    if save:
        return lambda: torch.index_select(cache, 0, ids, out=staging)
    return lambda: cache.index_copy_(0, ids, staging)


class StagingStreams:
    """Where the staged copy's stages run: CUDA streams and events, or, for a ``None``
    stream (the CPU), at once and in program order. Tests put a stand-in here that runs
    each stream's work in an adversarial order, bound only by the events."""

    def run(self, stream: torch.cuda.Stream | None, fn: Callable[[], object]) -> None:
        if stream is None:
            fn()
            return
        with torch.cuda.stream(stream):
            fn()

    def record(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream | None, event: object) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)


def _unpin(stream: torch.cuda.Stream | None, pinner: BackgroundPinner) -> None:
    """The tier's copies in flight end before its pages are unlocked."""
    if stream is not None:
        stream.synchronize()
    pinner.close()


def host_runs(ids: Sequence[int]) -> list[Run]:
    """(first id, its index in ``ids``, length) of each run of consecutive ``ids``."""
    runs: list[Run] = []
    for i, block in enumerate(ids):
        if runs and block == runs[-1][0] + runs[-1][2]:
            h0, at, n = runs[-1]
            runs[-1] = (h0, at, n + 1)
        else:
            runs.append((block, i, 1))
    return runs
