"""Upstream vLLM's ``Scheduler`` driving our policies: job order, job admission, KV pins.

``PolicyScheduler`` is the mechanism, the same as our engine's (docs/design.md, "Pins");
every decision is the policy's, the same object our engine runs
(``vllm_continuum.policy``, built by ``create_policy`` from the name in
``--additional-config '{"continuum": {"policy": ...}}'``, which the CLI sets):

- the waiting queue is the policy's ``queue_order``: ``job`` is ``vllm_continuum.queue``'s
  job order (``queue.py``), ``fcfs``/``priority`` upstream's own queues; when the policy
  orders victims (``victim_key``), ``running`` is sorted by it before each step, so
  upstream's FCFS preemption (it takes ``running[-1]``) preempts the policy's victim;
- a request that stops inside the engine asks the policy (``on_finished``); with a
  ``Pin``, its blocks stay allocated under its id (``_free_blocks`` is deferred) and
  ``vllm_continuum.pins`` ends the pin (hit, expiry, pressure before anyone is preempted:
  the allocation itself releases pins before it reports failure, a newer pin of the job,
  shutdown). Each pinned request's blocks go back to upstream's pool exactly once,
  through upstream's own ``_free_request_blocks`` (``pins.py``). With upstream's host KV
  tier (``--kv-offloading-size``, on by default for continuum and context_serve where
  upstream can offload: ``tier.py``) the policy is built with ``has_kv_tier=True``: the
  connector has saved every computed block, so a pin that ends, or yields to other jobs'
  turns (``pins_yield_to_tier``), and an ``Offload`` free the blocks and a later turn loads
  them back; without a tier an ``Offload`` frees and the context is recomputed;
- admission: a waiting request starts only when the policy allows it (``may_admit``,
  asked inside the allocation: a refusal is upstream's "cannot be scheduled", which ends
  this step's admissions, as in our engine);
- aborted requests are freed at once and skip ``on_finished`` (as in our engine).

Each class has an async-scheduling variant (``Async...``: the same class over upstream's
``AsyncScheduler``, which schedules a step while the previous one runs); the CLI picks it
when upstream turns async scheduling on (``cli.py``). The mechanism is the same in both:
a request finished by step N's output may already be scheduled in step N+1, whose KV
write then lands in its pinned blocks, which nobody else holds until the pin ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus
from vllm_continuum.clock import Clock, monotonic_clock
from vllm_continuum.config import PolicyConfig
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.pins import PinEntry
from vllm_continuum.policy import Pin, Policy, PolicySettings, create_policy
from vllm_continuum.upstream.compat import check_upstream
from vllm_continuum.upstream.metrics import PolicyStatTotals
from vllm_continuum.upstream.pins import UpstreamPinManager, pin_stats
from vllm_continuum.upstream.queue import JobOrderRequestQueue
from vllm_continuum.upstream.request_info import RequestInfo, request_info
from vllm_continuum.upstream.settings import (
    SECTION,
    context_serve_config_from,
    policy_config_from,
)
from vllm_continuum.upstream.tier import has_kv_tier

logger = logging.getLogger(__name__)

DEFAULT_POLICY = "continuum"  # a PolicyScheduler given no policy name
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


def policy_name_from(additional_config: dict[str, Any] | None) -> str:
    """The policy named in ``additional_config["continuum"]["policy"]`` (set by the CLI)."""
    section = (additional_config or {}).get(SECTION) or {}
    name = section.get("policy", DEFAULT_POLICY) if isinstance(section, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"additional_config[{SECTION!r}]['policy'] must be a name, got {name!r}")
    return name


class PolicyScheduler(Scheduler):
    """The pin, order and admission mechanism over upstream's scheduler; the decisions
    are ``self.agent_policy``'s (upstream's own ``self.policy`` stays its FCFS enum)."""

    policy_name: str | None = None  # a subclass fixed to one policy sets it

    def __init__(
        self,
        *args: Any,
        clock: Clock | None = None,
        decode: Callable[[Sequence[int]], str | None] | None = None,
        policy_config: PolicyConfig | None = None,
        context_serve_config: ContextServeConfig | None = None,
        policy_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Upstream's engine passes only upstream's arguments; ``clock``, ``decode`` (token
        ids -> text), ``policy_config``/``context_serve_config`` (else read from
        ``additional_config``) and ``policy_name`` are for tests and programmatic use."""
        check_upstream()
        super().__init__(*args, **kwargs)
        self.clock = clock or monotonic_clock
        additional = self.vllm_config.additional_config
        name = policy_name or self.policy_name or policy_name_from(additional)
        settings = PolicySettings.from_env(
            policy_config or policy_config_from(additional),
            context_serve_config or context_serve_config_from(additional),
        )
        self._decode = decode
        self.has_kv_tier = has_kv_tier(self.vllm_config)
        self.agent_policy: Policy = create_policy(
            name, settings, decode=self.decode, clock=self.clock, has_kv_tier=self.has_kv_tier
        )
        self.policy_config = self.agent_policy.config
        self.policy_stats = PolicyStatTotals(type(self.agent_policy).metrics())
        self.infos: dict[str, RequestInfo] = {}
        self._holding: set[str] = set()  # admitted, KV held: ids the policy counts running
        self.pin_manager = UpstreamPinManager(self)
        self.pins = self.pin_manager.pinned  # the pin table (by job)
        self.pin_counters = self.pin_manager.counters
        self.agent_policy.bind(self.pins)
        # Both queues in the policy's order (upstream drains the block-holding one first).
        self.waiting = self._make_queue()
        self.kv_holding_waiting = self._make_queue()
        kv = self.kv_cache_manager
        self._allocate_slots = kv.allocate_slots
        kv.allocate_slots = self._allocate_slots_admitting  # admission, pins before preemption
        logger.info("vllm-continuum-plugin: scheduling policy %s", name)

    @property
    def core(self) -> Any:
        """The policy's engine-agnostic decisions (``ContinuumCore`` and subclasses)."""
        return getattr(self.agent_policy, "core", None)

    def decode(self, token_ids: Sequence[int]) -> str | None:
        """Output text for the tool-call parser (the model's tokenizer, built on first use)."""
        if self._decode is None:
            model_config = self.vllm_config.model_config
            if model_config.skip_tokenizer_init:
                return None
            from vllm.tokenizers import cached_tokenizer_from_config

            tokenizer = cached_tokenizer_from_config(model_config)
            self._decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
        return self._decode(token_ids)

    def job_arrival(self, info: RequestInfo) -> float:
        return self.agent_policy.job_arrival(info)

    # -- upstream's seams -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests:  # else a streaming continuation
            now = self.clock()
            info = request_info(request, now)
            self.infos[request.request_id] = info
            self.agent_policy.on_arrival(info, now)
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any):
        first = self.waiting.peek_request() if self.waiting else None
        self.pin_manager.expire(self.clock(), self.info_of(first).job_key if first else None)
        if self.running and self._victim_order(self.running[-1]) is not None:
            # Upstream's FCFS preemption takes running[-1]: make it the policy's victim.
            self.running.sort(key=self._victim_order)
        return super().schedule(*args, **kwargs)

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        if request.request_id in self._holding:
            self._holding.discard(request.request_id)
            self.agent_policy.on_preempted(self.info_of(request), self.clock())

    def _free_blocks(self, request: Request) -> None:
        rid = request.request_id
        info = self.infos.get(rid)
        now = self.clock()
        was_running = rid in self._holding
        self._holding.discard(rid)
        action = None
        if info is not None and request.status in STOPPED:
            action = self.agent_policy.on_finished(info, now)
        elif info is not None:  # aborted (or an error): the policy never sees it finish
            self.agent_policy.on_aborted(info, was_running, now)
        if isinstance(action, Pin) and self.num_blocks(rid) > 0:
            del self.requests[rid]
            self.pin_manager.pin(request, action.ttl_s, now, strict=action.strict)
            return  # its info stays until the pin ends (the policy hears of it)
        super()._free_blocks(request)  # Free, and Offload (the connector saved the blocks)
        self.infos.pop(rid, None)

    def make_stats(self, *args: Any, **kwargs: Any):
        # The policy's own series (deltas each call) are summed here, whether or not
        # upstream reports this step (else they would be lost).
        self.policy_stats.add(self.agent_policy.make_stats())
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            # SchedulerStats has no field for plugins; this str->int dict reaches the front
            # end intact, where our stat logger takes its keys out (metrics.py).
            by_stage = stats.num_kv_fetch_reqs_by_stage
            by_stage.update(pin_stats(self.pins, self.pin_counters))
            self.policy_stats.write(by_stage)
        return stats

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        # Pinned blocks are in use: upstream would refuse to reset while pins exist.
        self.pin_manager.release_all(self.clock())
        return super().reset_prefix_cache(*args, **kwargs)

    def shutdown(self) -> None:
        self.pin_manager.release_all(self.clock())
        self.agent_policy.shutdown()
        super().shutdown()

    # -- pins (called by UpstreamPinManager) ----------------------------------------------
    def on_pinned(self, entry: PinEntry, now: float) -> None:
        self.job_pin_changed(entry.job)
        self.agent_policy.on_pinned(self.info_of(entry.request), now)

    def on_pin_released(self, entry: PinEntry, now: float, reason: str) -> None:
        self.job_pin_changed(entry.job)
        info = self.infos.pop(entry.request.request_id, None)
        if info is None:  # (kept from the pin on: not expected) a view without storing it
            info = request_info(entry.request, now)
        self.agent_policy.on_pin_released(info, now, reason)

    def may_release_pin(self, requester: Request, entry: PinEntry, now: float) -> bool:
        return self.agent_policy.may_release_pin(self.info_of(requester), entry.job_arrival, now)

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
            exclude = self.info_of(request).job_key
            if not self.pin_manager.release_for_pressure(request, self.clock(), exclude):
                return None

    def _may_admit(self, request: Request, hit: int, args: tuple, kwargs: dict) -> bool:
        info = self.infos.get(request.request_id)
        if info is None:
            return True
        external = _call_arg(args, kwargs, 4, "num_external_computed_tokens")
        new_tokens = request.num_tokens - hit - external
        free_tokens = self.kv_cache_manager.block_pool.get_num_free_blocks() * self.block_size
        return self.agent_policy.may_admit(info, new_tokens, free_tokens, self.clock())

    def _may_take_pins(self, request: Request, admitting: bool) -> bool:
        if not admitting:
            return True  # a running request: pins go before any preemption
        info = self.infos.get(request.request_id)
        if info is None:
            return False
        return self.agent_policy.may_release_pins_for(
            info, info.job_key in self.pins, len(self.running), self.clock()
        )

    def _admitted(self, request: Request, hit: int) -> None:
        info = self.infos.get(request.request_id)
        if info is None:
            return
        now = self.clock()
        self._holding.add(request.request_id)
        self.agent_policy.on_scheduled(info, hit, now)
        # The new turn now references the shared blocks: the pin has done its job.
        self.pin_manager.on_admitted(request, hit, now)

    # -- helpers --------------------------------------------------------------------------
    def num_blocks(self, request_id: str) -> int:
        try:
            return sum(len(ids) for ids in self.kv_cache_manager.get_block_ids(request_id))
        except KeyError:
            return 0

    def job_pin_changed(self, job: str) -> None:
        self.waiting.job_pin_changed(job)
        self.kv_holding_waiting.job_pin_changed(job)

    def _make_queue(self) -> Any:
        order = self.agent_policy.queue_order
        if order == "job":
            return JobOrderRequestQueue(
                job_of=lambda r: self.info_of(r).job_key,
                arrival_of=lambda r: self.info_of(r).arrival_time,
                job_arrival=lambda r: self.agent_policy.job_arrival(self.info_of(r)),
                clock=self.clock,
                wait_bound=lambda r: self.agent_policy.wait_bound(self.info_of(r)),
                pinned_jobs=self.pins,
            )
        if order in ("fcfs", "priority"):
            queue = create_request_queue(SchedulingPolicy(order))
            if not hasattr(queue, "job_pin_changed"):
                queue.job_pin_changed = lambda job: None  # upstream's queues ignore pins
            return queue
        raise ValueError(f"policy {self.agent_policy.name!r}: unknown queue_order {order!r}")

    def info_of(self, request: Request) -> RequestInfo:
        info = self.infos.get(request.request_id)
        if info is None:  # a request that bypassed add_request: its own job, now
            info = self.infos[request.request_id] = request_info(request, self.clock())
        return info

    def _victim_order(self, request: Request) -> Any:
        return self.agent_policy.victim_key(self.info_of(request))


class AsyncPolicyScheduler(PolicyScheduler, AsyncScheduler):
    """``PolicyScheduler`` with upstream's async scheduling (chosen by the CLI)."""


class ContinuumScheduler(PolicyScheduler):
    """Continuum (arXiv 2511.02230) on upstream vLLM, for ``--scheduler-cls
    vllm_continuum.upstream.scheduler.ContinuumScheduler`` (``--scheduling-policy
    continuum`` uses ``PolicyScheduler`` with the name)."""

    policy_name = "continuum"


class AsyncContinuumScheduler(ContinuumScheduler, AsyncScheduler):
    """``ContinuumScheduler`` with upstream's async scheduling (chosen by the CLI)."""
