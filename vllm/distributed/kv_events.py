"""KV cache events (vLLM's ``--kv-events-config``): what prefix-cache blocks the engine
holds, published for KV-aware routers.

Each step, the KV cache's changes are one ``KVEventBatch``: ``BlockStored`` when a block's
hash becomes held (its tokens, its parent's hash, medium ``"GPU"`` for the KV cache even on
a CPU, vLLM's name for the engine's own pool, and ``"CPU"`` for the host-memory tier),
``BlockRemoved`` when the last block holding a hash drops it, ``AllBlocksCleared`` when
the prefix cache is reset. Replaying the events in order gives exactly the hashes each
medium holds (tests/v1/core/test_kv_events.py checks that against the pools).

The wire format is vLLM's, so its subscribers decode ours: a ZeroMQ PUB socket sends
``(topic, sequence number as 8 big-endian bytes, msgpack payload)``; the payload is the
batch as an array ``[ts, events, data_parallel_rank]`` and each event a map tagged
``"type": "BlockStored"`` (and so on), its fields named as in vLLM. An optional ROUTER
socket (``replay_endpoint``) answers a request holding a starting sequence number (8
big-endian bytes) with every batch still buffered from there, then an end marker (sequence
-1, empty payload). Block hashes are this engine's own (sha256 chains, ``kv_cache_utils``):
opaque ids that link each block to its parent, sent as their low 64 bits unless
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from vllm import envs

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # the engine's KV cache (vLLM's name, whatever the device)
MEDIUM_CPU = "CPU"  # the host-memory tier (--kv-offloading-size)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the held blocks; encoded as a map with ``"type"``: the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block: the LoRA name and cache salt that entered its hash (None: nothing).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    # vLLM's optional fields, never set here (one full-attention group, one engine).
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None  # the job (agent session) whose request stored it


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash_fn() -> Callable[[bytes], ExternalBlockHash]:
    """How events name a block hash (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, read once):
    the low 64 bits of the big-endian digest (vLLM's default), or the digest itself."""
    if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return lambda h: int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF
    return bytes


class KVEventLog:
    """The events the pools record between two publications, in order.

    The KV cache (``BlockPool``) and the host tier (``CPUBlockPool``) share one log, so a
    block evicted from one and saved to the other reads in the order it happened.
    """

    def __init__(self) -> None:
        self.events: list[KVCacheEvent] = []
        self.external = external_hash_fn()

    def stored(
        self,
        block_hashes: list[bytes],
        parent: bytes | None,
        token_ids: list[int],
        block_size: int,
        medium: str,
        lora: Any = None,
        extra_keys: list[tuple[Any, ...] | None] | None = None,
        session_id: str | None = None,
    ) -> None:
        ext = self.external
        self.events.append(
            BlockStored(
                block_hashes=[ext(h) for h in block_hashes],
                parent_block_hash=None if parent is None else ext(parent),
                token_ids=token_ids,
                block_size=block_size,
                lora_id=None if lora is None else lora.lora_int_id,
                medium=medium,
                lora_name=None if lora is None else lora.lora_name,
                extra_keys=extra_keys,
                group_idx=0,
                session_id=session_id,
            )
        )

    def removed(self, block_hash: bytes, medium: str) -> None:
        """One hash left ``medium``; runs of removals from one medium share an event."""
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(self.external(block_hash))
        else:
            self.events.append(
                BlockRemoved(block_hashes=[self.external(block_hash)], medium=medium, group_idx=0)
            )

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or an ipc/inproc address is bound, the rest connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Data-parallel rank ``rank``'s own ZeroMQ address (vLLM's rule): a TCP port plus the
    rank (port 0 becomes a free port); an ipc path gets a suffix; inproc cannot reach
    another process. Rank 0 keeps ``endpoint``."""
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not int(port):
            from vllm.entrypoints.utils import get_open_port

            return f"tcp://{host}:{get_open_port()}"
        return f"tcp://{host}:{int(port) + rank}"
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_{rank}" if rank else endpoint
    raise ValueError(f"kv_events_config endpoint {endpoint!r}: several ranks need tcp:// or ipc://")


def rank_options(options: dict[str, Any], rank: int) -> dict[str, Any]:
    """``options`` of ``--kv-events-config`` for data-parallel rank ``rank``: its endpoints."""
    if rank == 0:
        return options
    out = dict(options)
    for key in ("endpoint", "replay_endpoint"):
        if out.get(key):
            out[key] = rank_endpoint(out[key], rank)
    return out


class ZmqEventPublisher:
    """Publishes ``KVEventBatch`` es from a thread; the engine's step only enqueues.

    The queue is bounded (``max_queue_size``): when the thread falls behind, batches are
    dropped and counted (a warning), never waited for; past ``hwm`` queued messages per
    subscriber ZeroMQ drops too. Subscribers see a gap in the sequence numbers and can ask
    the replay socket for the last ``buffer_steps`` batches.
    """

    POLL_S = 0.05
    SHUTDOWN_S = 2.0

    def __init__(self, options: dict[str, Any], data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self._topic = options["topic"].encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(options["max_queue_size"])
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options["buffer_steps"])
        self._seq = 0
        self.num_dropped = 0
        self._ctx = zmq.Context()
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(options["hwm"])
            self.endpoint = self._open(self._pub, options["endpoint"], "endpoint")
            if options["replay_endpoint"] is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = self._open(
                    self._replay, options["replay_endpoint"], "replay_endpoint", bind=True
                )
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        logger.info("Publishing KV cache events on %s", self.endpoint)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str, key: str, bind: bool | None = None) -> str:
        """Bind or connect; the address actually bound (``tcp://*:0`` picks a port)."""
        try:
            if bind or (bind is None and _is_bind_endpoint(endpoint)):
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as e:
            raise ValueError(f"kv_events_config.{key} {endpoint!r}: {e}") from None

    def publish(self, events: list[KVCacheEvent]) -> None:
        batch = KVEventBatch(ts=time.time(), events=events)
        batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped & (self.num_dropped - 1) == 0:  # 1, 2, 4, 8, ...
                logger.warning(
                    "KV events: %d batches dropped (the publisher is behind)", self.num_dropped
                )

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    logger.exception("KV events: a replay request failed")
            try:
                batch = self._queue.get(timeout=self.POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            seq = self._seq.to_bytes(8, "big")
            try:
                self._pub.send_multipart((self._topic, seq, payload))
            except zmq.ZMQError:
                logger.exception("KV events: sending batch %d failed", self._seq)
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a malformed replay request (%d frames)", len(frames))
            return
        client, empty, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, empty, self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, empty, b"", END_SEQ, b""))

    def shutdown(self) -> None:
        """Send what is queued (bounded wait), then close the sockets."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=self.SHUTDOWN_S)
            except queue.Full:
                pass
            self._thread.join(self.SHUTDOWN_S)
        if self._thread.is_alive():
            logger.warning(
                "KV events: the publisher did not stop; %d batches unsent", self._queue.qsize()
            )
            return  # its sockets are its own until it ends (a daemon thread)
        self._ctx.destroy(linger=int(self.SHUTDOWN_S * 1000))
