"""Disaggregated prefill: the engine's side of ``--kv-transfer-config``.

vLLM's protocol, as its routers drive it (vllm-router ``--vllm-pd-disaggregation``, vLLM's
toy proxy): the router sends the request to a **producer** with ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": true}``; the producer computes the prompt,
holds its KV and answers with ``kv_transfer_params`` naming where it is
(``remote_host``, ``remote_port``, ``remote_request_id``, ...). The router sends the
original request with those params to a **consumer**, which fetches the blocks and
decodes as if the prompt had been a prefix hit.

Both sides move blocks through the host-memory KV tier (``vllm.v1.kv_offload``), keyed by
the prefix hashes every instance of a model computes alike:

- **Producer.** When such a request finishes (length or stop), ``request_finished`` saves
  its computed prompt blocks into the tier and holds them there (the device blocks are
  freed or pinned as the policy says, at once); ``after_step`` runs the saves before the
  output leaves. The block server (``transport.KVBlockServer``, a thread) answers one fetch
  from the held blocks, then the hold ends; a hold no consumer fetched ends after
  ``abort_timeout_s`` (vLLM's 480 s).
- **Consumer.** ``maybe_fetch`` takes a request with ``do_remote_prefill`` before the
  scheduler sees it. Only the blocks past its local hit (the KV cache, then the tier) are
  fetched, on a thread: a job's next turn whose history is still pinned here moves only
  its new blocks. ``before_step`` stores the fetched blocks in the tier, held, and queues
  the request; the scheduler then finds them as a tier hit and loads them like any other
  (the prompt's last token and its partial block are computed here). The hold ends once
  the request is scheduled or gone. A failed fetch fails the request
  (``kv_load_failure_policy`` "fail", vLLM's default) or lets it compute its prompt
  ("recompute").

Everything that touches the tier's bookkeeping runs on the engine's thread; the server
thread only reads held blocks, and fetch threads only fill buffers of their own.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import zmq

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.transport import KVBlockServer, TransferError, request_blocks
from vllm.v1.metrics.stats import KVTransferStats
from vllm.v1.request import Request, RequestStatus

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_offload.worker import CPUOffloadingHandler

logger = logging.getLogger(__name__)

FETCH_THREADS = 4
COUNTERS = (
    "blocks_sent", "blocks_received", "bytes_received", "fetch_seconds", "failed_fetches",
    "expired_holds",
)  # fmt: skip
IDLE_WAIT_S = 0.05  # the longest an otherwise idle step waits for a fetch


def _sum_counters(a: KVTransferStats, b: KVTransferStats) -> KVTransferStats:
    return KVTransferStats(**{f: getattr(a, f) + getattr(b, f) for f in COUNTERS})


def transfer_params(request: Request) -> dict[str, Any] | None:
    params = (request.sampling_params.extra_args or {}).get("kv_transfer_params")
    return params or None


def check_transfer_params(params: Any, producer: bool, consumer: bool) -> None:
    """A request's ``kv_transfer_params``: ValueError naming the key for what this engine
    cannot do (no connector, the wrong role, a consumer's request without an address)."""
    if params is None or params == {}:
        return
    name = "kv_transfer_params"
    if not isinstance(params, dict):
        raise ValueError(f"{name} must be an object, got {type(params).__name__}")
    if not (producer or consumer):
        raise ValueError(f"{name}: this server has no --kv-transfer-config")
    for key in ("do_remote_decode", "do_remote_prefill"):
        if not isinstance(params.get(key, False), bool):
            raise ValueError(f"{name}.{key} must be a boolean")
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise ValueError(f"{name}: do_remote_decode and do_remote_prefill exclude each other")
    if params.get("do_remote_decode") and not producer:
        raise ValueError(f"{name}.do_remote_decode: this server's kv_role is kv_consumer")
    if params.get("do_remote_prefill"):
        if not consumer:
            raise ValueError(f"{name}.do_remote_prefill: this server's kv_role is kv_producer")
        for key, kind in (("remote_host", str), ("remote_port", int), ("remote_request_id", str)):
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) or value == "":
                raise ValueError(f"{name}.{key} must be a {kind.__name__} (the producer's answer)")


@dataclass
class _Hold:
    """A producer's finished request: its prompt blocks held in the tier for a fetch."""

    hashes: list[bytes]
    ids: list[int]
    expires: float
    ready: bool = False  # the saves into the tier ran
    served: bool = False
    sent: int = 0  # blocks sent


@dataclass
class _Fetch:
    """A consumer's request waiting for its blocks."""

    request: Request
    start: int  # first block fetched
    hashes: list[bytes]
    params: dict[str, Any]
    started: float = field(default_factory=time.monotonic)
    chunks: list[list[torch.Tensor]] | None = None  # per layer and K/V, one per run
    runs: list[int] = field(default_factory=list)  # the producer's run lengths
    num_blocks: int = 0
    error: str | None = None
    cancelled: bool = False


class KVTransferConnector:
    """One engine's producer and consumer sides (``kv_role`` says which run).

    ``admit(request)`` queues a request whose blocks arrived (the engine's normal path);
    ``notify()`` wakes an idle engine loop (a fetch is back, a hold was served)."""

    def __init__(
        self,
        config: KVTransferConfig,
        kv_cache_manager: KVCacheManager,
        handler: Callable[[], CPUOffloadingHandler | None],
        block_size: int,
        admit: Callable[[Request], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        opts = config.options
        self.producer, self.consumer = config.is_producer, config.is_consumer
        # A data-parallel rank (-dp N; dp_client.py sets VLLM_DP_RANK) is an engine of its
        # own: rank r listens on kv_port + r (vLLM's rule for its side channels) and names
        # itself <engine_id>_dp<r>.
        rank = os.environ.get("VLLM_DP_RANK")
        self.engine_id = opts["engine_id"] or uuid.uuid4().hex
        port = opts["kv_port"]
        if rank is not None:
            self.engine_id = f"{self.engine_id}_dp{rank}"
            port = port and port + int(rank)
        self.fail_on_error = opts["kv_load_failure_policy"] == "fail"
        self.abort_timeout_s = opts["abort_timeout_s"]
        self.fetch_timeout_s = opts["fetch_timeout_s"]
        self.kvm = kv_cache_manager
        self.offload = kv_cache_manager.offload
        assert self.offload is not None, "disaggregated prefill moves blocks through the tier"
        # The runner's tier handler, read at each use: sleep mode frees it and wake-up
        # makes a new one.
        self._handler = handler
        tier = handler()
        assert tier is not None, "disaggregated prefill moves blocks through the tier"
        self._layouts = tier.layouts()  # one block's shape and dtype per layer and K/V
        self.block_size = block_size
        self.admit = admit
        self.clock = clock
        self.notify: Callable[[], None] = lambda: None  # the engine loop's wake-up
        self._news = threading.Event()  # a fetch arrived (for an idle step's wait)
        self.stats = KVTransferStats()  # deltas since take_stats
        self._taken = KVTransferStats()  # the counters take_stats handed out, summed
        self.ctx = zmq.Context()
        # Producer: holds by request id (the server thread reads them under the lock).
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._unready: list[str] = []  # finished this step: their saves run in after_step
        self._served: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.server: KVBlockServer | None = None
        self.host = opts["kv_ip"]
        if self.producer:
            self.server = KVBlockServer(self.ctx, self.host, port, self._serve)
            logger.info(
                "KV transfer (%s, %s): serving held blocks on %s:%d, engine %s",
                config.kv_transfer_config["kv_connector"], opts["kv_role"], self.host,
                self.server.port, self.engine_id,
            )  # fmt: skip
        # Consumer: requests waiting for their blocks, and the tier blocks held for them.
        self._fetching: dict[str, _Fetch] = {}
        self._arrived: queue.SimpleQueue[_Fetch] = queue.SimpleQueue()
        self._consumer_holds: dict[str, list[int]] = {}
        self._threads = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kv-fetch")

    @property
    def tier(self) -> CPUOffloadingHandler:
        handler = self._handler()
        if handler is None:
            raise TransferError("the engine is asleep: its CPU KV tier is released")
        return handler

    # -- producer -------------------------------------------------------------------------
    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """A request ended (the scheduler, before it frees the blocks): for a producer's
        prefill, its computed prompt blocks are saved to the tier and held; the params the
        consumer needs are returned (None for other requests)."""
        params = transfer_params(request)
        if not (self.producer and params and params.get("do_remote_decode")):
            return None
        ok = (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        if request.status not in ok:
            return None
        groups = self.kvm.req_to_blocks.get(request.request_id)
        computed = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        hashes, ids = [], []
        for block in (groups[0] if groups else [])[:computed]:
            if block.block_hash is None:
                break
            cpu_id = self.offload.save_and_hold(block)
            if cpu_id is None:  # the tier is full of held blocks: the rest is recomputed
                break
            hashes.append(block.block_hash)
            ids.append(cpu_id)
        rid = request.request_id
        with self._lock:
            old = self._holds.pop(rid, None)  # an id reused before its hold was fetched
            self._holds[rid] = _Hold(hashes, ids, self.clock() + self.abort_timeout_s)
        if old is not None:
            self.offload.unhold(old.ids)
        self._unready.append(rid)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": rid,
            "remote_host": self.host,
            "remote_port": self.server.port if self.server else None,
            "remote_block_ids": ids,
            "remote_num_tokens": len(ids) * self.block_size,
            "tp_size": 1,
        }

    def _run_saves(self, run_plan: Callable[[], None]) -> None:
        """Run the planned saves now, so the held blocks hold data before the params
        leave; a failure drops the holds (their consumers fetch nothing)."""
        rids, self._unready = self._unready, []
        try:
            run_plan()
            self.tier.synchronize()
        except Exception:
            logger.exception("KV transfer: saving %d prefill(s) to the tier failed", len(rids))
            for rid in rids:
                self._drop_hold(rid)
            return
        with self._lock:
            for rid in rids:
                hold = self._holds.get(rid)
                if hold is not None:
                    hold.ready = True

    def _serve(
        self, header: dict[str, Any]
    ) -> tuple[dict[str, Any], list[torch.Tensor], Callable[[], None]]:
        """The server thread: one fetch or release of a held request's blocks. The reply's
        tensors are views of the held tier blocks; the hold ends once they are sent."""
        rid = header.get("request_id")
        with self._lock:
            hold = self._holds.get(rid)  # type: ignore[arg-type]
            if hold is None or not hold.ready or hold.served:
                raise TransferError(f"no blocks held for request {rid!r} (expired or fetched)")
            hold.served = True

        def on_sent() -> None:
            self._served.put(rid)  # type: ignore[arg-type]
            self.notify()

        try:
            if header.get("op") == "release":
                return {"num_blocks": 0, "runs": []}, [], on_sent
            if header.get("op") != "fetch":
                raise TransferError(f"unknown op {header.get('op')!r}")
            start = int(header.get("start", 0))
            wanted = [bytes.fromhex(h) for h in header.get("hashes", [])]
            n = 0
            while (
                n < len(wanted)
                and start + n < len(hold.hashes)
                and hold.hashes[start + n] == wanted[n]
            ):
                n += 1
            runs, views = self.tier.block_views(hold.ids[start : start + n])
            hold.sent = n
            return {"num_blocks": n, "runs": runs}, views, on_sent
        except Exception:
            on_sent()
            raise

    def _drop_hold(self, rid: str) -> None:
        with self._lock:
            hold = self._holds.pop(rid, None)
        if hold is not None:
            self.offload.unhold(hold.ids)

    def _release_served(self) -> None:
        while True:
            try:
                rid = self._served.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                hold = self._holds.get(rid)
                if hold is None or not hold.served:
                    continue
                sent = hold.sent
            self.stats.blocks_sent += sent
            self._drop_hold(rid)
        now = self.clock()
        with self._lock:
            expired = [r for r, h in self._holds.items() if h.expires <= now and not h.served]
        for rid in expired:
            logger.warning(
                "KV transfer: no consumer fetched request %s's blocks in %.0f s; freed",
                rid, self.abort_timeout_s,
            )  # fmt: skip
            self.stats.expired_holds += 1
            self._drop_hold(rid)

    # -- consumer -------------------------------------------------------------------------
    def maybe_fetch(self, request: Request) -> bool:
        """Take a request whose prompt another instance computed (``do_remote_prefill``):
        True when its blocks are being fetched (``admit`` queues it once they are here)."""
        params = transfer_params(request)
        if not (self.consumer and params and params.get("do_remote_prefill")):
            return False
        if request.request_id in self._fetching:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        bs = self.block_size
        end = (request.num_tokens - 1) // bs  # never the last token: its logits are needed
        start = 0
        if not request.skip_reading_prefix_cache:
            start = self.kvm.get_computed_blocks(request)[1] // bs
            start += self.offload.lookup(request.block_hashes[start:end])
        fetch = _Fetch(request, start, list(request.block_hashes[start:end]), params)
        if start >= end or request.skip_reading_prefix_cache:
            # Every block is here already (or none can be read): the producer's hold ends.
            self._threads.submit(self._release_remote, fetch)
            return False
        self._fetching[request.request_id] = fetch
        self._threads.submit(self._fetch, fetch)
        return True

    def _release_remote(self, fetch: _Fetch) -> None:
        p = fetch.params
        header = {"op": "release", "request_id": p["remote_request_id"]}
        try:
            request_blocks(
                self.ctx, p["remote_host"], p["remote_port"], header, self.fetch_timeout_s
            )
        except TransferError as e:
            logger.info("KV transfer: release of %s at the producer: %s", p["remote_request_id"], e)

    def _fetch(self, fetch: _Fetch) -> None:
        """A fetch thread: the blocks into buffers of its own, then back to the engine."""
        p = fetch.params
        header = {
            "op": "fetch",
            "request_id": p["remote_request_id"],
            "start": fetch.start,
            "hashes": [h.hex() for h in fetch.hashes],
        }
        try:
            reply, layers = request_blocks(
                self.ctx, p["remote_host"], p["remote_port"], header, self.fetch_timeout_s
            )
            n = int(reply.get("num_blocks", 0))
            runs = [int(r) for r in reply.get("runs", [])]
            if sum(runs) != n or len(layers) != len(runs) * len(self._layouts):
                raise TransferError("the reply's runs and tensors do not add up to num_blocks")
            chunks = [
                layers[i * len(runs) : (i + 1) * len(runs)] for i in range(len(self._layouts))
            ]
            for (shape, dtype), parts in zip(self._layouts, chunks, strict=True):
                for run, t in zip(runs, parts, strict=True):
                    if tuple(t.shape) != (run, *shape) or t.dtype != dtype:
                        raise TransferError(
                            f"the producer's KV blocks are {tuple(t.shape[1:])} {t.dtype}, this "
                            f"engine's {shape} {dtype} (another model, KV dtype or block size)"
                        )
            fetch.chunks, fetch.runs, fetch.num_blocks = chunks, runs, n
        except Exception as e:  # noqa: BLE001 - reported to the engine's thread
            fetch.error = str(e)
        self._arrived.put(fetch)
        self._news.set()
        self.notify()

    def _take_arrivals(self) -> list[tuple[str, str, bool]]:
        """Store fetched blocks in the tier, held for their request, and admit it. Returns
        the requests that failed, as (request id, message, whether the servers' side
        failed): a failed fetch under the "fail" policy, or a request the scheduler
        refused (its own values)."""
        failed = []
        while True:
            try:
                fetch = self._arrived.get_nowait()
            except queue.Empty:
                return failed
            rid = fetch.request.request_id
            if fetch.cancelled or self._fetching.get(rid) is not fetch:
                continue  # aborted while its blocks travelled
            del self._fetching[rid]
            self.stats.fetch_seconds += time.monotonic() - fetch.started
            if fetch.error is None and fetch.num_blocks:
                try:
                    self._store(fetch)
                except TransferError as e:  # asleep: no tier to store in
                    fetch.error = str(e)
            if fetch.error is not None:
                self.stats.failed_fetches += 1
                error = fetch.error
                logger.warning("KV transfer: fetching request %s's blocks failed: %s", rid, error)
                if self.fail_on_error:
                    message = f"kv_transfer_params: fetching the KV failed: {error}"
                    failed.append((rid, message, True))
                    continue
            try:
                self.admit(fetch.request)
            except ValueError as e:  # e.g. a prompt longer than the KV cache holds
                self._unhold_consumer(rid)
                failed.append((rid, str(e), False))

    def _store(self, fetch: _Fetch) -> None:
        """The fetched blocks into tier blocks held for the request: one memcpy per run
        that is consecutive both in the reply and in the tier, per layer and K/V."""
        ids, copies = [], []
        where = [(r, row) for r, n in enumerate(fetch.runs) for row in range(n)]
        for i, block_hash in enumerate(fetch.hashes[: fetch.num_blocks]):
            got = self.offload.store_and_hold(block_hash)
            if got is None:  # every tier block is held: the rest is computed here
                break
            cpu_id, fill = got
            ids.append(cpu_id)
            if not fill:  # the tier had it (another request saved it meanwhile)
                continue
            run, row = where[i]
            if copies:
                r0, row0, c0, n = copies[-1]
                if run == r0 and row == row0 + n and cpu_id == c0 + n:
                    copies[-1] = (r0, row0, c0, n + 1)
                    continue
            copies.append((run, row, cpu_id, 1))
        if copies:
            self.tier.write_runs(copies, fetch.chunks)
        self._consumer_holds[fetch.request.request_id] = ids
        self.stats.blocks_received += len(ids)
        self.stats.bytes_received += sum(
            t.numel() * t.element_size() for parts in fetch.chunks for t in parts
        )
        fetch.chunks = None

    def cancel(self, request_ids: list[str]) -> list[str]:
        """Aborted requests: those still fetching are dropped (returned)."""
        cancelled = []
        for rid in request_ids:
            fetch = self._fetching.pop(rid, None)
            if fetch is not None:
                fetch.cancelled = True
                cancelled.append(rid)
        return cancelled

    # -- the engine's loop ------------------------------------------------------------------
    def before_step(self, idle: bool = False) -> list[tuple[str, str, bool]]:
        """Between steps, on the engine's thread: holds fetched or expired end, fetched
        blocks are stored and their requests admitted. Returns the failed requests.
        ``idle``: the step has nothing else to do, so it waits (a little) for a fetch
        rather than spin (an offline ``LLM`` steps while requests are unfinished)."""
        if idle and self._fetching and self._arrived.empty():
            self._news.wait(IDLE_WAIT_S)
        self._news.clear()
        self._release_served()
        return self._take_arrivals()

    def after_step(self, settled: Callable[[str], bool], run_plan: Callable[[], None]) -> None:
        """After a step's update: the producer's saves run now; the consumer's holds end
        for requests ``settled`` (scheduled, so their loads are planned, or gone)."""
        if self._unready:
            self._run_saves(run_plan)
        for rid in [r for r in self._consumer_holds if settled(r)]:
            self._unhold_consumer(rid)

    def _unhold_consumer(self, rid: str) -> None:
        ids = self._consumer_holds.pop(rid, None)
        if ids is not None:
            self.offload.unhold(ids)

    def drop_holds(self) -> None:
        """Every hold ends (the prefix cache is being reset: the held KV is stale)."""
        with self._lock:
            rids = list(self._holds)
        for rid in rids:
            self._drop_hold(rid)
        for ids in self._consumer_holds.values():
            self.offload.unhold(ids)
        self._consumer_holds.clear()

    def take_stats(self) -> KVTransferStats:
        """The counts since the previous call, with the holds and fetches now."""
        stats, self.stats = self.stats, KVTransferStats()
        self._taken = _sum_counters(self._taken, stats)
        with self._lock:
            stats.held_requests = len(self._holds)
        stats.fetching_requests = len(self._fetching)
        return stats

    def totals(self) -> KVTransferStats:
        """The counters since the start (for tests and logs)."""
        return _sum_counters(self._taken, self.stats)

    @property
    def num_fetching(self) -> int:
        return len(self._fetching)

    @property
    def fetching_ids(self) -> list[str]:
        return list(self._fetching)

    def next_wakeup(self) -> float | None:
        """Now when blocks arrived or a hold was served; else the earliest hold expiry."""
        if not self._arrived.empty() or not self._served.empty():
            return self.clock()
        with self._lock:
            return min((h.expires for h in self._holds.values() if not h.served), default=None)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.ctx.destroy(linger=0)
