"""Upstream vLLM's ``Scheduler`` with job-level order and KV pins.

``AgentScheduler`` is the mechanism, the same as our engine's (docs/design.md, "Pins"):

- the waiting queue is ordered by ``job_order.waiting_key`` (``queue.py``); ``running`` is
  sorted by ``job_order.victim_key`` before each step, so upstream's FCFS preemption (it
  takes ``running[-1]``) preempts the newest job's non-last-step request;
- a request that stops inside the engine asks the policy core for a TTL; with one, its
  blocks stay allocated under its id (``_free_blocks`` is deferred) and the pin ends at
  the job's next admission (a hit), at expiry (unless the job's turn is first in line),
  under memory pressure (newest job first, before anyone is preempted: the allocation
  itself releases pins before it reports failure), when the job pins a newer turn, and at
  shutdown. Each pinned request's blocks go back to upstream's pool exactly once, through
  upstream's own ``_free_request_blocks``;
- aborted requests are freed at once and skip the policy (as in our engine).

Subclasses supply the decisions (``create_core`` and the ``on_*`` hooks):
``ContinuumScheduler`` below; a ContextServe binding subclasses the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus
from vllm_continuum.clock import Clock, monotonic_clock
from vllm_continuum.config import PolicyConfig
from vllm_continuum.continuum import ContinuumCore
from vllm_continuum.job_order import victim_key, waiting_key
from vllm_continuum.upstream import pins as P
from vllm_continuum.upstream.compat import check_upstream
from vllm_continuum.upstream.queue import JobOrderRequestQueue
from vllm_continuum.upstream.request_info import RequestInfo, request_info
from vllm_continuum.upstream.settings import policy_config_from

logger = logging.getLogger(__name__)

# Statuses of a request that stopped inside the engine: the policy decides its blocks' fate.
STOPPED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        getattr(RequestStatus, "FINISHED_REPETITION", RequestStatus.FINISHED_STOPPED),
    }
)
WAITING = frozenset({RequestStatus.WAITING, RequestStatus.PREEMPTED})


class AgentScheduler(Scheduler):
    """The pin and job-order mechanism over upstream's scheduler; decisions in subclasses."""

    def __init__(
        self,
        *args: Any,
        clock: Clock | None = None,
        decode: Callable[[list[int]], str] | None = None,
        policy_config: PolicyConfig | None = None,
        **kwargs: Any,
    ) -> None:
        """Upstream's engine passes only upstream's arguments; ``clock``, ``decode`` (token
        ids -> text) and ``policy_config`` (else read from ``additional_config``) are for
        tests and programmatic use."""
        check_upstream()
        super().__init__(*args, **kwargs)
        self.clock = clock or monotonic_clock
        self.policy_config = policy_config or policy_config_from(self.vllm_config.additional_config)
        self._decode = decode
        self.core = self.create_core(self.policy_config)
        self.infos: dict[str, RequestInfo] = {}
        self.pins = P.PinTable()
        self.pin_counters = P.PinCounters()
        # Both queues are job-ordered (upstream drains the block-holding one first).
        self.waiting = self._make_queue()
        self.kv_holding_waiting = self._make_queue()
        kv = self.kv_cache_manager
        self._allocate_slots = kv.allocate_slots
        kv.allocate_slots = self._allocate_slots_releasing_pins  # pins go before preemption

    # -- decisions (subclasses) -----------------------------------------------------------
    def create_core(self, config: PolicyConfig) -> Any:
        raise NotImplementedError

    def job_arrival(self, info: RequestInfo) -> float:
        """The first arrival of the request's job (a higher value is a newer job)."""
        return info.arrival

    def on_arrival(self, request: Request, info: RequestInfo, now: float) -> None:
        pass

    def on_scheduled(self, request: Request, info: RequestInfo, hit: int, now: float) -> None:
        pass

    def finished_ttl(self, request: Request, info: RequestInfo, now: float) -> float:
        """A request stopped in the engine: seconds to keep its blocks (0: free now)."""
        return 0.0

    def on_pin_released(self, entry: P.PinEntry, now: float, reason: str) -> None:
        pass

    def may_release_pins_for(self, info: RequestInfo, own_job_pinned: bool, now: float) -> bool:
        """Whether a waiting request that does not fit may take pinned memory: its own job
        holds a pin, nothing runs, or it waited longer than ``max_wait_s``."""
        return (
            own_job_pinned or not self.running or now - info.arrival > self.policy_config.max_wait_s
        )

    def decode(self, token_ids: list[int]) -> str | None:
        """Output text for the tool-call parser (the model's tokenizer, built on first use)."""
        if self._decode is None:
            model_config = self.vllm_config.model_config
            if model_config.skip_tokenizer_init:
                return None
            from vllm.tokenizers import cached_tokenizer_from_config

            tokenizer = cached_tokenizer_from_config(model_config)
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        return self._decode(token_ids)

    # -- upstream's seams -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:  # else a streaming continuation
            now = self.clock()
            info = request_info(request, now)
            self.infos[request.request_id] = info
            self.on_arrival(request, info, now)
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any):
        now = self.clock()
        self._expire_pins(now)
        # Upstream's FCFS preemption takes running[-1]: make it the policy's victim.
        self.running.sort(key=self._victim_order)
        return super().schedule(*args, **kwargs)

    def _free_blocks(self, request: Request) -> None:
        info = self.infos.pop(request.request_id, None)
        now = self.clock()
        ttl = 0.0
        if info is not None and request.status in STOPPED:
            ttl = self.finished_ttl(request, info, now)
        num_blocks = self._num_blocks(request.request_id)
        if ttl > 0 and num_blocks > 0:
            del self.requests[request.request_id]
            self._pin(request, info, ttl, num_blocks, now)
        else:
            super()._free_blocks(request)

    def make_stats(self, *args: Any, **kwargs: Any):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            # SchedulerStats has no field for plugins; this str->int dict reaches the front
            # end intact, where our stat logger takes its keys out (metrics.py).
            stats.num_kv_fetch_reqs_by_stage.update(P.pin_stats(self.pins, self.pin_counters))
        return stats

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        # Pinned blocks are in use: upstream would refuse to reset while pins exist.
        self._release_all(self.clock(), P.PIN_RELEASE_SHUTDOWN)
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        self._release_all(self.clock(), P.PIN_RELEASE_SHUTDOWN)
        self.core_shutdown()
        super().shutdown()

    def core_shutdown(self) -> None:
        shutdown = getattr(self.core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # -- admission and pressure -----------------------------------------------------------
    def _allocate_slots_releasing_pins(self, request: Request, *args: Any, **kwargs: Any):
        """Upstream's ``allocate_slots``, releasing pins (newest job first) while it fails
        and the request may take pinned memory; a successful admission may be a pin hit."""
        admitting = request.status in WAITING
        while True:
            blocks = self._allocate_slots(request, *args, **kwargs)
            if blocks is not None:
                if admitting:
                    hit = kwargs.get("num_new_computed_tokens", args[1] if len(args) > 1 else 0)
                    self._admitted(request, int(hit or 0))
                return blocks
            if not self.pins or not self._may_take_pins(request, admitting):
                return None
            info = self.infos.get(request.request_id)
            job = self.pins.newest_job(exclude=info.job if info else None)
            self._release(job, self.clock(), P.PIN_RELEASE_PRESSURE)

    def _may_take_pins(self, request: Request, admitting: bool) -> bool:
        if not admitting:
            return True  # a running request: pins go before any preemption
        info = self.infos.get(request.request_id)
        if info is None:
            return False
        return self.may_release_pins_for(info, info.job in self.pins, self.clock())

    def _admitted(self, request: Request, hit: int) -> None:
        info = self.infos.get(request.request_id)
        if info is None:
            return
        now = self.clock()
        self.on_scheduled(request, info, hit, now)
        if info.job in self.pins:
            # The new turn now references the shared blocks: the pin has done its job.
            if hit > 0:
                self.pin_counters.hits += 1
            self._release(info.job, now, P.PIN_RELEASE_HIT)

    # -- pins -----------------------------------------------------------------------------
    def _pin(self, request: Request, info: RequestInfo, ttl: float, n: int, now: float) -> None:
        entry = P.PinEntry(request, info.job, now + ttl, self.job_arrival(info), n)
        old = self.pins.add(entry)
        self.pin_counters.pins += 1
        if old is not None:
            self._free_entry(old, now, P.PIN_RELEASE_REPLACED)
        self._job_pin_changed(info.job)

    def _release(self, job: str, now: float, reason: str) -> None:
        entry = self.pins.remove(job)
        if entry is not None:
            self._free_entry(entry, now, reason)
            self._job_pin_changed(job)

    def _free_entry(self, entry: P.PinEntry, now: float, reason: str) -> None:
        self._free_request_blocks(entry.request)  # the one place a pin's blocks go back
        if reason == P.PIN_RELEASE_EXPIRED:
            self.pin_counters.expiries += 1
        elif reason == P.PIN_RELEASE_PRESSURE:
            self.pin_counters.pressure_releases += 1
        self.on_pin_released(entry, now, reason)

    def _expire_pins(self, now: float) -> None:
        """End the pins whose TTL passed, except the pin of the job first in line (about to
        take its hit); holding pins for turns stuck behind others would deadlock memory."""
        first = self.waiting.peek_request() if self.waiting else None
        info = self.infos.get(first.request_id) if first is not None else None
        next_job = info.job if info else None
        kept = []
        for entry in list(self.pins.expired(now)):
            if entry.job == next_job:
                kept.append(entry)
            else:
                self._release(entry.job, now, P.PIN_RELEASE_EXPIRED)
        for entry in kept:
            self.pins.rearm(entry)

    def _release_all(self, now: float, reason: str) -> None:
        for job in self.pins.jobs():
            self._release(job, now, reason)

    def next_pin_deadline(self) -> float | None:
        return self.pins.next_deadline()

    # -- helpers --------------------------------------------------------------------------
    def _num_blocks(self, request_id: str) -> int:
        try:
            return sum(len(ids) for ids in self.kv_cache_manager.get_block_ids(request_id))
        except KeyError:
            return 0

    def _job_pin_changed(self, job: str) -> None:
        self.waiting.job_pin_changed(job)
        self.kv_holding_waiting.job_pin_changed(job)

    def _make_queue(self) -> JobOrderRequestQueue:
        return JobOrderRequestQueue(
            key=self._waiting_order,
            job_of=lambda r: self._info(r).job,
            arrival_of=lambda r: self._info(r).arrival,
            clock=self.clock,
            max_wait_s=self.policy_config.max_wait_s,
        )

    def _info(self, request: Request) -> RequestInfo:
        info = self.infos.get(request.request_id)
        if info is None:  # a request that bypassed add_request: its own job, now
            info = self.infos[request.request_id] = request_info(request, self.clock())
        return info

    def _waiting_order(self, request: Request) -> tuple:
        info = self._info(request)
        return waiting_key(info.job in self.pins, self.job_arrival(info), info.arrival)

    def _victim_order(self, request: Request) -> tuple:
        info = self._info(request)
        return victim_key(info.is_last_step, self.job_arrival(info), info.arrival)


class ContinuumScheduler(AgentScheduler):
    """Continuum (arXiv 2511.02230) on upstream vLLM: ``--scheduling-policy continuum``, or
    ``--scheduler-cls vllm_continuum.upstream.scheduler.ContinuumScheduler``."""

    policy_name = "continuum"

    def create_core(self, config: PolicyConfig) -> ContinuumCore:
        import os

        # The per-job event log, as in our engine (RUN_OUTPUT_DIR, when set).
        return ContinuumCore(config, self.clock, record_dir=os.environ.get("RUN_OUTPUT_DIR"))

    def job_arrival(self, info: RequestInfo) -> float:
        return self.core.job_arrival(info.job, info.arrival)

    def on_arrival(self, request: Request, info: RequestInfo, now: float) -> None:
        self.core.on_arrival(
            info.job, request.request_id, now, info.named, request.num_prompt_tokens
        )

    def on_scheduled(self, request: Request, info: RequestInfo, hit: int, now: float) -> None:
        kept = info.job in self.pins or request.num_preemptions > 0
        self.core.on_scheduled(
            info.job,
            request.request_id,
            now,
            now - info.arrival,
            context_kept=kept,
            hit=hit,
            num_tokens=request.num_tokens,
        )

    def finished_ttl(self, request: Request, info: RequestInfo, now: float) -> float:
        text = self.decode(list(request.output_token_ids)) if request.output_token_ids else None
        return self.core.on_finished(
            info.job,
            request.request_id,
            now,
            text,
            is_last_step=info.is_last_step,
            named=info.named,
            num_tokens=request.num_tokens,
        )

    def on_pin_released(self, entry: P.PinEntry, now: float, reason: str) -> None:
        self.core.on_pin_released(entry.job, entry.request.request_id, reason)
