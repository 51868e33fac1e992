"""Upstream vLLM's ``Scheduler`` with job-level order, job admission and KV pins.

``AgentScheduler`` is the mechanism, the same as our engine's (docs/design.md, "Pins"):

- the waiting queue is ``vllm_continuum.queue``'s job order (``queue.py``); ``running`` is
  sorted by ``job_order.victim_key`` before each step, so upstream's FCFS preemption (it
  takes ``running[-1]``) preempts the newest job's non-last-step request;
- a request that stops inside the engine asks the decisions for a pin; with one, its
  blocks stay allocated under its id (``_free_blocks`` is deferred) and
  ``vllm_continuum.pins`` ends the pin (hit, expiry, pressure before anyone is preempted:
  the allocation itself releases pins before it reports failure, a newer pin of the job,
  shutdown). Each pinned request's blocks go back to upstream's pool exactly once,
  through upstream's own ``_free_request_blocks`` (``pins.py``);
- job admission: a new job's first turn starts only when the decisions allow it
  (``may_admit``, asked inside the allocation: a refusal is upstream's "cannot be
  scheduled", which ends this step's admissions, as in our engine);
- aborted requests are freed at once and skip the decisions (as in our engine).

Subclasses supply the decisions (``create_core`` and the hooks under "decisions"):
``ContinuumScheduler`` below, ``ContextServeScheduler`` in ``context_serve.py``. Each has
an async-scheduling variant (``Async...``: the same class over upstream's
``AsyncScheduler``, which schedules a step while the previous one runs); the CLI picks it
when upstream turns async scheduling on (``cli.py``). The mechanism is the same in both:
a request finished by step N's output may already be scheduled in step N+1, whose KV
write then lands in its pinned blocks, which nobody else holds until the pin ends.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus
from vllm_continuum.clock import Clock, monotonic_clock
from vllm_continuum.config import PolicyConfig
from vllm_continuum.continuum import ContinuumCore
from vllm_continuum.job_order import victim_key
from vllm_continuum.pins import PinEntry
from vllm_continuum.turns import FinishedTurn
from vllm_continuum.upstream.compat import check_upstream
from vllm_continuum.upstream.pins import UpstreamPinManager, pin_stats
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


def _call_arg(args: tuple, kwargs: dict, index: int, name: str) -> int:
    """An ``allocate_slots`` argument after ``request``, passed by position or name."""
    value = kwargs.get(name, args[index] if len(args) > index else 0)
    return int(value or 0)


class AgentScheduler(Scheduler):
    """The pin, order and admission mechanism over upstream's scheduler."""

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
        self._holding: set[str] = set()  # admitted, KV held: ids the decisions count running
        self.pin_manager = UpstreamPinManager(self)
        self.pins = self.pin_manager.pinned  # the pin table (by job)
        self.pin_counters = self.pin_manager.counters
        # Both queues are job-ordered (upstream drains the block-holding one first).
        self.waiting = self._make_queue()
        self.kv_holding_waiting = self._make_queue()
        kv = self.kv_cache_manager
        self._allocate_slots = kv.allocate_slots
        kv.allocate_slots = self._allocate_slots_admitting  # admission, pins before preemption

    # -- decisions (subclasses) -----------------------------------------------------------
    def create_core(self, config: PolicyConfig) -> Any:
        raise NotImplementedError

    def job_arrival(self, info: RequestInfo) -> float:
        """The first arrival of the request's job (a higher value is a newer job)."""
        return info.arrival

    def wait_bound(self, info: RequestInfo) -> float:
        """Seconds a waiting request may wait before it is served regardless of order."""
        return self.policy_config.max_wait_s

    def on_arrival(self, request: Request, info: RequestInfo, now: float) -> None:
        pass

    def on_scheduled(self, request: Request, info: RequestInfo, hit: int, now: float) -> None:
        pass

    def finished_pin(self, request: Request, info: RequestInfo, now: float) -> tuple[float, bool]:
        """A request stopped in the engine: (seconds to keep its blocks, 0 frees them now;
        whether the pin is strict: released under pressure after every soft pin)."""
        return 0.0, False

    def on_kv_released(self, request: Request, info: RequestInfo, now: float) -> None:
        """An admitted request lost its KV without finishing (preempted or aborted)."""

    def on_pin_released(self, entry: PinEntry, now: float, reason: str) -> None:
        pass

    def may_admit(
        self, request: Request, info: RequestInfo, new_tokens: int, free_tokens: int, now: float
    ) -> bool:
        """Whether the waiting request first in line may start now, needing ``new_tokens``
        of KV with ``free_tokens`` free (or evictable). Default: yes."""
        return True

    def may_release_pins_for(self, info: RequestInfo, own_job_pinned: bool, now: float) -> bool:
        """Whether a waiting request that does not fit may take pinned memory: its own job
        holds a pin, nothing runs, or it waited longer than ``max_wait_s``."""
        return (
            own_job_pinned or not self.running or now - info.arrival > self.policy_config.max_wait_s
        )

    def may_release_pin(self, info: RequestInfo, entry: PinEntry, now: float) -> bool:
        """Whether the request ``info`` (out of memory) may take another job's pin."""
        return True

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
        first = self.waiting.peek_request() if self.waiting else None
        self.pin_manager.expire(self.clock(), self.info_of(first).job if first else None)
        # Upstream's FCFS preemption takes running[-1]: make it the policy's victim.
        self.running.sort(key=self._victim_order)
        return super().schedule(*args, **kwargs)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self._lost_kv(request)

    def _free_blocks(self, request: Request) -> None:
        rid = request.request_id
        info = self.infos.get(rid)
        now = self.clock()
        ttl, strict = 0.0, False
        if info is not None and request.status in STOPPED:
            self._holding.discard(rid)
            ttl, strict = self.finished_pin(request, info, now)
        else:
            self._lost_kv(request)  # aborted (or an error): the decisions never see it end
        if ttl > 0 and self.num_blocks(rid) > 0:
            del self.requests[rid]
            self.pin_manager.pin(request, ttl, now, strict=strict)
        else:
            super()._free_blocks(request)
        self.infos.pop(rid, None)

    def make_stats(self, *args: Any, **kwargs: Any):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            # SchedulerStats has no field for plugins; this str->int dict reaches the front
            # end intact, where our stat logger takes its keys out (metrics.py).
            stats.num_kv_fetch_reqs_by_stage.update(pin_stats(self.pins, self.pin_counters))
        return stats

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        # Pinned blocks are in use: upstream would refuse to reset while pins exist.
        self.pin_manager.release_all(self.clock())
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        self.pin_manager.release_all(self.clock())
        self.core_shutdown()
        super().shutdown()

    def core_shutdown(self) -> None:
        shutdown = getattr(self.core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # -- admission and pressure -----------------------------------------------------------
    def _allocate_slots_admitting(self, request: Request, *args: Any, **kwargs: Any):
        """Upstream's ``allocate_slots``: a waiting request is first asked ``may_admit``;
        while the allocation fails and the request may take pinned memory, pins are
        released (newest job first); a successful admission may be a pin hit."""
        admitting = request.status in WAITING
        hit = _call_arg(args, kwargs, 1, "num_new_computed_tokens")
        while True:
            if admitting and not self._may_admit(request, hit, args, kwargs):
                return None
            blocks = self._allocate_slots(request, *args, **kwargs)
            if blocks is not None:
                if admitting:
                    self._admitted(request, hit)
                return blocks
            if not self.pins or not self._may_take_pins(request, admitting):
                return None
            exclude = self.info_of(request).job
            if not self.pin_manager.release_for_pressure(request, self.clock(), exclude):
                return None

    def _may_admit(self, request: Request, hit: int, args: tuple, kwargs: dict) -> bool:
        info = self.infos.get(request.request_id)
        if info is None:
            return True
        external = _call_arg(args, kwargs, 4, "num_external_computed_tokens")
        new_tokens = request.num_tokens - hit - external
        free_tokens = self.kv_cache_manager.block_pool.get_num_free_blocks() * self.block_size
        return self.may_admit(request, info, new_tokens, free_tokens, self.clock())

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
        self._holding.add(request.request_id)
        self.on_scheduled(request, info, hit, now)
        # The new turn now references the shared blocks: the pin has done its job.
        self.pin_manager.on_admitted(request, hit, now)

    def _lost_kv(self, request: Request) -> None:
        if request.request_id in self._holding:
            self._holding.discard(request.request_id)
            info = self.infos.get(request.request_id)
            if info is not None:
                self.on_kv_released(request, info, self.clock())

    # -- helpers --------------------------------------------------------------------------
    def num_blocks(self, request_id: str) -> int:
        try:
            return sum(len(ids) for ids in self.kv_cache_manager.get_block_ids(request_id))
        except KeyError:
            return 0

    def job_pin_changed(self, job: str) -> None:
        self.waiting.job_pin_changed(job)
        self.kv_holding_waiting.job_pin_changed(job)

    def _make_queue(self) -> JobOrderRequestQueue:
        return JobOrderRequestQueue(
            job_of=lambda r: self.info_of(r).job,
            arrival_of=lambda r: self.info_of(r).arrival,
            job_arrival=lambda r: self.job_arrival(self.info_of(r)),
            clock=self.clock,
            wait_bound=lambda r: self.wait_bound(self.info_of(r)),
            pinned_jobs=self.pins,
        )

    def info_of(self, request: Request) -> RequestInfo:
        info = self.infos.get(request.request_id)
        if info is None:  # a request that bypassed add_request: its own job, now
            info = self.infos[request.request_id] = request_info(request, self.clock())
        return info

    def _victim_order(self, request: Request) -> tuple:
        info = self.info_of(request)
        return victim_key(info.is_last_step, self.job_arrival(info), info.arrival)


class ContinuumScheduler(AgentScheduler):
    """Continuum (arXiv 2511.02230) on upstream vLLM: ``--scheduling-policy continuum``, or
    ``--scheduler-cls vllm_continuum.upstream.scheduler.ContinuumScheduler``."""

    def create_core(self, config: PolicyConfig) -> ContinuumCore:
        # The per-job event log, as in our engine (RUN_OUTPUT_DIR, when set).
        return ContinuumCore(config, self.clock, record_dir=os.environ.get("RUN_OUTPUT_DIR"))

    def job_arrival(self, info: RequestInfo) -> float:
        return self.core.job_arrival(info.job, info.arrival)

    def wait_bound(self, info: RequestInfo) -> float:
        return self.core.wait_bound_s(info.job)

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

    def finished_pin(self, request: Request, info: RequestInfo, now: float) -> tuple[float, bool]:
        return self.core.on_finished(self._finished_turn(request, info, now)), False

    def _finished_turn(self, request: Request, info: RequestInfo, now: float) -> FinishedTurn:
        """A finished request as the core's plain values (its output decoded to text)."""
        text = self.decode(list(request.output_token_ids)) if request.output_token_ids else None
        return FinishedTurn(
            job=info.job,
            request_id=request.request_id,
            now=now,
            text=text,
            is_last_step=info.is_last_step,
            named=info.named,
            num_tokens=request.num_tokens,
            last_unless_tool_call=info.last_unless_tool_call,
        )

    def on_kv_released(self, request: Request, info: RequestInfo, now: float) -> None:
        self.core.on_kv_released(info.job, request.num_tokens, now)

    def on_pin_released(self, entry: PinEntry, now: float, reason: str) -> None:
        self.core.on_pin_released(entry.job, entry.request.request_id, reason)

    # -- job-level admission and pressure (vllm_continuum.admission) ----------------------
    def may_admit(
        self, request: Request, info: RequestInfo, new_tokens: int, free_tokens: int, now: float
    ) -> bool:
        return self.core.may_admit(
            info.job, new_tokens, free_tokens, self.pins, now - info.arrival, now
        )

    def may_release_pins_for(self, info: RequestInfo, own_job_pinned: bool, now: float) -> bool:
        if not self.policy_config.job_admission:
            return super().may_release_pins_for(info, own_job_pinned, now)
        return True  # which pins it may take is decided pin by pin (may_release_pin)

    def may_release_pin(self, info: RequestInfo, entry: PinEntry, now: float) -> bool:
        if not self.policy_config.job_admission:
            return True
        waited = now - info.arrival
        return self.core.may_release_pin(self.job_arrival(info), entry.job_arrival, waited)


class AsyncContinuumScheduler(ContinuumScheduler, AsyncScheduler):
    """``ContinuumScheduler`` with upstream's async scheduling (chosen by the CLI)."""
