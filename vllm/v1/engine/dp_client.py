"""Data parallelism (vLLM's ``--data-parallel-size N``): N engine cores behind one front end.

Each data-parallel rank is an ordinary engine-core process (``AsyncMPClient``) with its
own device (on CUDA the rank's GPU; on the CPU its share of the cores) and its own KV
cache. ``DPAsyncMPClient`` has ``AsyncMPClient``'s interface, so ``AsyncLLM`` does not
know how many engines there are:

- **A request goes to one rank.** A job's requests (its ``job_id``, or what names the job)
  all go to the rank that served its first turn, which is where its KV, pinned by
  Continuum while its tool runs, is. Otherwise (a new job, a request without one) the
  least loaded rank gets it: running + 4 x waiting requests as of each rank's latest
  step, plus what was sent to it since (vLLM's balance), plus the jobs whose KV the rank
  pins (``VLLM_DP_PINNED_WEIGHT`` each, 1 by default). A pinned job is an agent whose tool
  is running: it has no request in the engine, but its next turn will come back to that
  rank, so vLLM's balance, which does not see it, would pile new jobs onto the rank whose
  agents are all between turns. ``X-data-parallel-rank`` on the
  HTTP request (``EngineCoreRequest.data_parallel_rank``) picks the rank outright, as
  vLLM's routers send it.
- **Aborts and stops** go to the rank that holds the request.
- **Utility calls** (sleep, pause, reset_prefix_cache, weight sync, ...) go to every rank;
  the caller gets one answer once all ranks answered: the first error, else for yes/no
  answers whether every rank said yes, for weight checksums each tensor's where the ranks
  agree (``combine_checksums``), else rank 0's.
- **Outputs** of all ranks are read as they come, each marked with its rank
  (``engine_index``: the metrics' ``engine`` label) and its own stats (``engine_stats``);
  ``scheduler_stats`` carries the gauges (requests running and waiting, KV usage, pins,
  ...) over all ranks, which the front end's load, admission and log line read, and the
  deltas as they are.

Any rank's death is the engine's death: every request fails, as with one engine.

**Several API servers** (``--api-server-count M``, which ``-dp N`` sets to N unless given,
as in vLLM): ``vllm serve`` starts the N engines, each with M front-end socket pairs, and M
API server processes, each with a ``DPAsyncMPClient`` over ``DPLink`` (every rank's
``EngineLink``). The job table and the requests sent since each rank's latest stats live
in shared memory (``SharedJobTable``, ``SentSinceStats``), so a job's turn follows its KV
whichever API server the agent's connection reached, and every server balances on what
all of them sent. Every step's stats reach every server.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm import envs
from vllm.config import VllmConfig
from vllm.v1.engine import (
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityResult,
)
from vllm.v1.engine.core_client import AsyncMPClient, EngineDeadError, EngineLink

logger = logging.getLogger(__name__)

# Jobs remembered for affinity (least recently used forgotten first).
MAX_JOBS = 100_000
WAITING_WEIGHT = 4  # vLLM's: a waiting request weighs as 4 running ones

# The gauges of SchedulerStats, by attribute path, and how ranks combine: the sum over
# ranks, or their mean (usages). tests/v1/engine/test_dp_client.py checks that every
# gauge series on /metrics is here.
DP_GAUGES: dict[str, str] = {
    "num_running_reqs": "sum",
    "num_waiting_reqs": "sum",
    "kv_cache_usage": "mean",
    "pin_stats.num_pinned_requests": "sum",
    "pin_stats.pinned_kv_blocks": "sum",
    "offload_stats.usage": "mean",
    "kv_transfer_stats.held_requests": "sum",
    "kv_transfer_stats.fetching_requests": "sum",
    "state_checkpoint_stats.cached": "sum",
    "state_checkpoint_stats.offloaded": "sum",
}


def combine_checksums(by_rank: list[dict[str, str]]) -> dict[str, str]:
    """One weight-checksum answer for every rank (``/weight_checker``): a tensor's digest
    where the ranks agree, else ``"differ by rank: <rank 0's>, <rank 1's>, ..."`` (no
    rank's own digest), so a comparison finds a rank a weight sync missed."""
    combined = {}
    for name in sorted(set().union(*by_rank)):
        digests = [checksums.get(name, "missing") for checksums in by_rank]
        same = all(d == digests[0] for d in digests)
        combined[name] = digests[0] if same else "differ by rank: " + ", ".join(digests)
    return combined


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def combine_stats(latest: list[Any], current: Any) -> Any:
    """``current`` (one rank's stats; not changed) with its gauges over every rank's
    ``latest`` stats (None: a rank not heard from yet)."""
    out = copy.copy(current)
    for path, how in DP_GAUGES.items():
        *parents, name = path.split(".")
        values = [v for s in latest if s is not None and (v := _get(s, path)) is not None]
        holder = out
        for part in parents:  # copy the nested stats it changes, not the rank's own
            inner = getattr(holder, part, None)
            if inner is None:
                break
            inner = copy.copy(inner)
            setattr(holder, part, inner)
            holder = inner
        else:
            if values:
                total = sum(values)
                setattr(holder, name, total / len(values) if how == "mean" else total)
    return out


class JobTable:
    """job -> the rank that holds its KV, for one API server; the least recently used job
    is forgotten first past ``capacity``."""

    def __init__(self, capacity: int = MAX_JOBS) -> None:
        self._jobs: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity

    def rank_of(self, job: str, pick: Callable[[], int]) -> int:
        """The job's rank; a job not known yet gets ``pick()`` and keeps it."""
        rank = self._jobs.get(job)
        if rank is None:
            rank = pick()
        self.assign(job, rank)
        return rank

    def assign(self, job: str, rank: int) -> None:
        self._jobs[job] = rank
        self._jobs.move_to_end(job)
        if len(self._jobs) > self._capacity:
            self._jobs.popitem(last=False)


class SharedJobTable:
    """``JobTable`` in shared memory, for the API servers of one ``vllm serve``: a
    set-associative table of job hashes (8 ways to a set; within a set the least
    recently used job is forgotten first), under one lock. Made by the supervisor before
    it spawns the API servers, which get it as a process argument."""

    WAYS = 8

    def __init__(self, ctx: Any, slots: int = 1 << 17) -> None:
        if slots % self.WAYS:
            raise ValueError(f"slots {slots} must be a multiple of {self.WAYS}")
        self._keys = ctx.RawArray("q", slots)  # a job's hash; 0: empty
        self._ranks = ctx.RawArray("i", slots)
        self._used = ctx.RawArray("q", slots)  # the clock at its last use
        self._clock = ctx.RawValue("q", 0)
        self._lock = ctx.Lock()
        self._sets = slots // self.WAYS

    @staticmethod
    def _hash(job: str) -> int:
        digest = hashlib.blake2b(job.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True) or 1

    def _slot(self, key: int) -> tuple[int, bool]:
        """The slot that holds ``key`` (True), else the one it would take (False)."""
        first = (key % self._sets) * self.WAYS
        victim = first
        for slot in range(first, first + self.WAYS):
            if self._keys[slot] == key:
                return slot, True
            if self._used[slot] < self._used[victim]:
                victim = slot
        return victim, False

    def _store(self, slot: int, key: int, rank: int) -> None:
        self._clock.value += 1
        self._keys[slot], self._ranks[slot], self._used[slot] = key, rank, self._clock.value

    def rank_of(self, job: str, pick: Callable[[], int]) -> int:
        key = self._hash(job)
        with self._lock:
            slot, found = self._slot(key)
            rank = self._ranks[slot] if found else pick()
            self._store(slot, key, rank)
        return rank

    def assign(self, job: str, rank: int) -> None:
        key = self._hash(job)
        with self._lock:
            self._store(self._slot(key)[0], key, rank)


class SentSinceStats:
    """Requests sent to each rank since its latest stats, as a rank's load counts them.
    One API server: its own counts. Several: ``counters`` is a shared array with a row per
    API server; each writes only its own row (reset when it reads the rank's next stats,
    which every server gets) and reads the sum over the rows."""

    def __init__(self, size: int, counters: Any = None, index: int = 0, count: int = 1):
        self._counts = [0] * size if counters is None else counters
        self._size, self._row, self._rows = size, index * size, count

    def add(self, rank: int) -> None:
        self._counts[self._row + rank] += 1

    def reset(self, rank: int) -> None:
        self._counts[self._row + rank] = 0

    def total(self, rank: int) -> int:
        return sum(self._counts[row * self._size + rank] for row in range(self._rows))


@dataclass
class DPLink:
    """How one of several API servers reaches the data-parallel engines that ``vllm
    serve`` started: each rank's ``EngineLink`` (all with this server's index), the
    shared job table and the shared sent-request counts (``SentSinceStats``)."""

    links: list[EngineLink]
    jobs: SharedJobTable
    sent_counters: Any

    @property
    def client_index(self) -> int:
        return self.links[0].client_index

    @property
    def client_count(self) -> int:
        return self.links[0].client_count

    @property
    def admission_counters(self) -> Any:
        return self.links[0].admission_counters


def dp_engine_envs(size: int) -> list[dict[str, str]]:
    """Each rank's engine environment (``rank_env``); ``ValueError`` when CUDA is there
    but has fewer GPUs than ranks."""
    import torch

    cuda = torch.cuda.is_available()  # the engines' device, as ModelRunner picks it
    if cuda and torch.cuda.device_count() < size:
        raise ValueError(
            f"data_parallel_size {size} needs {size} GPUs, one per engine; "
            f"{torch.cuda.device_count()} are visible"
        )
    return [rank_env(rank, size, cuda) for rank in range(size)]


def rank_env(rank: int, size: int, cuda: bool) -> dict[str, str]:
    """The environment of rank ``rank``'s engine process: its rank, and its GPU or its
    share of the CPU's threads (``VLLM_CPU_THREADS`` set by the user is each engine's
    own count)."""
    env = {"VLLM_DP_RANK": str(rank)}  # its KV events' endpoints and batches say it
    if cuda:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(size)]
        env["CUDA_VISIBLE_DEVICES"] = devices[rank]
    elif not os.environ.get("VLLM_CPU_THREADS"):
        env["VLLM_CPU_THREADS"] = str(max(1, envs.VLLM_CPU_THREADS // size))
    return env


class DPAsyncMPClient:
    """``data_parallel_size`` engine cores, one ``AsyncMPClient`` each (module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        startup_timeout_s: float = 600.0,
        engine_factory: Any = None,
        link: DPLink | None = None,
    ) -> None:
        """``link``: attach to engines that ``vllm serve`` started (one of several API
        servers); None: start this front end's own."""
        size = vllm_config.parallel_config.data_parallel_size
        self.client_index = 0 if link is None else link.client_index
        self.engines: list[AsyncMPClient] = []
        self._reads: dict[int, asyncio.Task] = {}
        try:
            if link is None:
                for env in dp_engine_envs(size):
                    self.engines.append(
                        AsyncMPClient(vllm_config, startup_timeout_s, engine_factory, env=env)
                    )
            else:
                for rank_link in link.links:
                    self.engines.append(AsyncMPClient(vllm_config, link=rank_link))
        except BaseException:
            self.shutdown()
            raise
        self.info: EngineCoreReady | None = None
        self._dead_reason: str | None = None
        self._stats: list[Any] = [None] * size
        if link is None:
            self._sent = SentSinceStats(size)
            self._jobs: JobTable | SharedJobTable = JobTable()
        else:
            self._sent = SentSinceStats(
                size, link.sent_counters, link.client_index, link.client_count
            )
            self._jobs = link.jobs
        self._owner: dict[str, int] = {}  # request id -> its rank, until it ends
        self._pinned_weight = envs.VLLM_DP_PINNED_WEIGHT
        self._ready: collections.deque = collections.deque()
        # call id -> [answers still due, first error, answers by rank, method]
        self._calls: dict[int, list] = {}

    # -- AsyncMPClient's interface ---------------------------------------------------------
    @property
    def proc(self):
        return self.engines[0].proc

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason or next(
            (e.dead_reason for e in self.engines if e.dead_reason), None
        )

    @dead_reason.setter
    def dead_reason(self, reason: str | None) -> None:
        self._dead_reason = reason

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and all(e.is_alive for e in self.engines)

    @property
    def exit_description(self) -> str:
        dead = [f"rank {r}: {e.exit_description}" for r, e in enumerate(self.engines)
                if not e.is_alive]  # fmt: skip
        return "; ".join(dead) or "running"

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(
                self.dead_reason or f"an engine core process died ({self.exit_description})"
            )

    def mark_dead(self, reason: str) -> EngineDeadError:
        self._dead_reason = reason
        for engine in self.engines:
            engine.mark_dead(reason)
        return EngineDeadError(reason)

    async def wait_ready(self) -> EngineCoreReady:
        """Every rank's READY; the smallest KV cache is what a request can count on."""
        readies = await asyncio.gather(*(e.wait_ready() for e in self.engines))
        self.info = EngineCoreReady(
            num_gpu_blocks=min(r.num_gpu_blocks for r in readies), pid=readies[0].pid
        )
        logger.info(
            "Data parallel: %d engines (pids %s), %s KV blocks",
            len(readies), ", ".join(str(r.pid) for r in readies),
            " + ".join(str(r.num_gpu_blocks) for r in readies),
        )  # fmt: skip
        return self.info

    async def send(self, msg_type: EngineCoreRequestType, payload: Any) -> None:
        self._check_alive()
        match msg_type:
            case EngineCoreRequestType.ADD:
                rank = payload.data_parallel_rank
                if rank is None:
                    rank = self.choose_rank(payload)
                self._owner[payload.request_id] = rank
                self._sent.add(rank)
                await self.engines[rank].send(msg_type, payload)
            case EngineCoreRequestType.ABORT | EngineCoreRequestType.STOP:
                # The engine sends no ending for these (the front end has forgotten
                # them), so their owners are forgotten here, as the engine process does.
                by_rank: dict[int, list[str]] = {}
                for request_id in payload:
                    rank = self._owner.pop(request_id, None)
                    for r in range(len(self.engines)) if rank is None else (rank,):
                        by_rank.setdefault(r, []).append(request_id)
                for rank, ids in by_rank.items():
                    await self.engines[rank].send(msg_type, ids)
            case EngineCoreRequestType.UTILITY:
                self._calls[payload.call_id] = [len(self.engines), None, {}, payload.method]
                for engine in self.engines:
                    await engine.send(msg_type, payload)
            case _:
                for engine in self.engines:
                    await engine.send(msg_type, payload)

    async def recv(self, timeout_s: float = 1.0) -> tuple[EngineCoreOutputType, Any] | None:
        """The next message of any rank (None on timeout); ``EngineDeadError`` if one died."""
        while not self._ready:
            for rank, engine in enumerate(self.engines):
                if rank not in self._reads:
                    self._reads[rank] = asyncio.ensure_future(engine.recv(timeout_s))
            done, _ = await asyncio.wait(
                self._reads.values(), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                return None
            for rank in sorted(self._reads):
                task = self._reads[rank]
                if not task.done():
                    continue
                del self._reads[rank]
                msg = task.result()  # EngineDeadError: the output loop fails everything
                if msg is not None:
                    self._take(rank, *msg)
        return self._ready.popleft()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        for task in self._reads.values():
            task.cancel()
        self._reads.clear()
        for engine in self.engines:
            engine.shutdown(timeout_s)

    # -- routing ---------------------------------------------------------------------------
    def _load(self, rank: int) -> float:
        stats = self._stats[rank]
        load = self._sent.total(rank)
        if stats is not None:
            load += stats.num_running_reqs + WAITING_WEIGHT * stats.num_waiting_reqs
            pins = stats.pin_stats
            if pins is not None:  # jobs between turns: their next turns come here
                load += self._pinned_weight * pins.num_pinned_requests
        return load

    def choose_rank(self, request: EngineCoreRequest, asked: int | None = None) -> int:
        """The rank for ``request`` (and its siblings, n > 1): ``asked`` (the client's
        X-data-parallel-rank), else the job's rank, else the least loaded one."""
        size = len(self.engines)
        job = request.sampling_params.job_id
        if asked is not None:
            if not 0 <= asked < size:
                raise ValueError(
                    f"data_parallel_rank {asked} is not a rank of this server (0-{size - 1})"
                )
            if job is not None:
                self._jobs.assign(job, asked)  # the job's KV is there now: its turns follow
            return asked

        def least_loaded() -> int:
            return min(range(size), key=lambda r: (self._load(r), r))

        return least_loaded() if job is None else self._jobs.rank_of(job, least_loaded)

    # -- what comes back -------------------------------------------------------------------
    def _take(self, rank: int, msg_type: EngineCoreOutputType, payload: Any) -> None:
        match msg_type:
            case EngineCoreOutputType.OUTPUTS:
                outputs = payload.outputs
                outputs.engine_index = rank  # the metrics' engine label
                for out in outputs.outputs:
                    if out.finished:
                        self._owner.pop(out.request_id, None)
                if outputs.scheduler_stats is not None:
                    self._stats[rank] = outputs.engine_stats = outputs.scheduler_stats
                    self._sent.reset(rank)
                    outputs.scheduler_stats = combine_stats(self._stats, outputs.scheduler_stats)
                self._ready.append((msg_type, payload))
            case EngineCoreOutputType.REQUEST_ERROR:
                self._owner.pop(payload.request_id, None)
                self._ready.append((msg_type, payload))
            case EngineCoreOutputType.UTILITY_RESULT:
                call = self._calls.get(payload.call_id)
                if call is None:  # not a broadcast of ours: pass it on
                    self._ready.append((msg_type, payload))
                    return
                call[0] -= 1
                if payload.error is not None and call[1] is None:
                    call[1] = payload.error
                call[2][rank] = payload.result
                if call[0] == 0:
                    del self._calls[payload.call_id]
                    self._ready.append((msg_type, self._combined(payload.call_id, call)))
            case _:  # FATAL, or a protocol error: AsyncLLM marks the engine dead
                self._ready.append((msg_type, payload))

    def _combined(self, call_id: int, call: list) -> UtilityResult:
        answer = UtilityResult(call_id)
        if call[1] is not None:
            answer.error = call[1]
            return answer
        results = [call[2][r] for r in sorted(call[2])]
        if results and all(isinstance(r, bool) for r in results):
            answer.result = all(results)
        elif call[3] == "compute_weight_checksums" and results:
            answer.result = combine_checksums(results)
        else:
            answer.result = results[0] if results else None
        return answer
