"""The policy seam shared by every engine: the decisions that differ between policies.

Both schedulers (ours in ``vllm.v1.core.sched``, upstream vLLM's through the plugin in
``vllm_continuum.upstream``) build their policy with ``create_policy`` and keep only the
mechanism: queues, allocation, preemption, the pins a policy asks for. They ask the
policy at these points (docs/design.md, "The policy seam"):

1. the waiting order: ``queue_order`` names the engine's queue (``fcfs``, ``priority``, or
   ``job``: ``vllm_continuum.queue``'s job order, keyed by ``job_arrival`` and
   ``wait_bound``);
2. which running request to preempt: the one with the largest ``victim_key`` (``None``:
   the engine's default, the last admitted);
3. what to do with a finished request's blocks: ``on_finished`` -> ``Free`` /
   ``Pin(ttl_s)`` / ``Offload``;
4. admission and memory pressure: ``may_admit``, ``may_release_pins_for``,
   ``may_release_pin``;
5. observers: ``on_arrival``, ``on_scheduled``, ``on_preempted``, ``on_aborted``,
   ``on_pinned``, ``on_pin_released``.

Every hook takes a ``RequestView``: the few read-only facts of a request both engines
provide (our ``Request`` is one; the plugin wraps upstream's). A policy's own metrics are
data (``metrics()``: ``MetricSpec`` s read from ``make_stats()``'s object); each engine's
exporter builds the series without knowing the policy.

Policies own no KV blocks and keep no copy of the scheduler's state: the pins belong to
the scheduler, which hands the policy a read-only view of the pinned jobs (``bind``).
Time comes only from the ``now`` arguments and the injected clock.

Contract on finished requests: ``on_finished`` is called for every request that stops
inside the engine (EOS, stop token, ``max_tokens``, length cap); aborted requests are
always freed and skip it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from vllm_continuum.clock import Clock, monotonic_clock
from vllm_continuum.config import PolicyConfig
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.metrics import MetricSpec

# Why a pin ended (argument of ``on_pin_released``): defined with the pin mechanism.
from vllm_continuum.pins import (  # noqa: F401 - re-exported for policies
    PIN_RELEASE_EXPIRED,
    PIN_RELEASE_HIT,
    PIN_RELEASE_PRESSURE,
    PIN_RELEASE_REPLACED,
    PIN_RELEASE_SHUTDOWN,
)

QueueOrder = Literal["fcfs", "priority", "job"]


class RequestView(Protocol):
    """What a policy may read of a request, in every engine (read-only).

    ``arrival_time`` is on the scheduler's clock (the one passed to the policy)."""

    @property
    def request_id(self) -> str: ...
    @property
    def job_key(self) -> str: ...  # its job_id, or the request itself (vllm_continuum.jobs)
    @property
    def named(self) -> bool: ...  # the client named its job (a job_id)
    @property
    def is_last_step(self) -> bool: ...
    @property
    def last_unless_tool_call(self) -> bool: ...  # last turn unless the output calls a tool
    @property
    def arrival_time(self) -> float: ...
    @property
    def priority(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class Free:
    """Release the finished request's blocks now (they stay prefix-cached until evicted)."""


@dataclass(frozen=True)
class Pin:
    """Keep the finished request's blocks referenced for ``ttl_s`` seconds.

    A ``strict`` pin (ContextServe's FAST turns: the tool returns soon, surely) ends only
    by its job's hit, its deadline, shutdown, or when memory pressure finds no soft pin
    left to release: pressure releases soft pins first. It never outlives ``ttl_s``, so
    strictness cannot deadlock memory."""

    ttl_s: float
    strict: bool = False

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s!r}")


@dataclass(frozen=True)
class Offload:
    """Copy the blocks to the CPU tier, then free them (an engine without a tier frees)."""


FinishedAction = Free | Pin | Offload
FREE = Free()


@dataclass(frozen=True)
class PolicySettings:
    """Everything a policy is configured with, whichever engine parsed it: the shared
    knobs (``PolicyConfig``), ContextServe's section, and where per-job event logs go."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    context_serve: ContextServeConfig = field(default_factory=ContextServeConfig)
    record_dir: str | None = None

    @classmethod
    def from_env(
        cls, policy: PolicyConfig | None = None, context_serve: ContextServeConfig | None = None
    ) -> PolicySettings:
        """With ``record_dir`` from ``RUN_OUTPUT_DIR`` (both engines read that variable)."""
        return cls(
            policy or PolicyConfig(),
            context_serve or ContextServeConfig(),
            os.environ.get("RUN_OUTPUT_DIR") or None,
        )


class Policy:
    """Base class of scheduling policies. Defaults are plain vLLM behaviour (FCFS).

    Subclasses register under a name in ``registry.py``; ``create_policy`` builds every
    policy the same way: ``from_settings`` with the engine's facts (``has_kv_tier``)."""

    name: str = "base"
    queue_order: QueueOrder = "fcfs"
    # Whether the policy reads finished outputs as text (then ``decode`` is required).
    needs_decode: bool = False
    # Whether the policy keeps jobs' contexts across turns, so that an engine gives it a
    # host-memory KV tier when the user sets no size (ours: ``--kv-offloading-size``).
    wants_kv_tier: bool = False

    def __init__(
        self,
        settings: PolicySettings | None = None,
        decode: Callable[[Sequence[int]], str | None] | None = None,
        clock: Clock = monotonic_clock,
        has_kv_tier: bool = False,
    ) -> None:
        """``decode``: token ids -> text, for policies that read finished outputs;
        ``has_kv_tier``: whether the engine saves freed and released blocks in a CPU KV
        tier (an engine fact, derived once by the engine)."""
        self.settings = settings or PolicySettings()
        self.config = self.settings.policy
        self.decode = decode
        self.clock = clock
        self.has_tier = has_kv_tier
        self.pinned_jobs: Container[str] = frozenset()

    @classmethod
    def from_settings(
        cls,
        settings: PolicySettings,
        decode: Callable[[Sequence[int]], str | None] | None,
        clock: Clock,
        has_kv_tier: bool,
    ) -> Policy:
        """Build from the parsed settings and the engine's facts (a policy that adapts its
        settings to the engine does it here); ``create_policy`` calls this."""
        return cls(settings, decode=decode, clock=clock, has_kv_tier=has_kv_tier)

    def bind(self, pinned_jobs: Container[str]) -> None:
        """The scheduler's live, read-only view of the jobs holding pinned blocks (called
        once, before any request; ``on_pinned``/``on_pin_released`` say when it changes)."""
        self.pinned_jobs = pinned_jobs

    def prepare(self, measure_prefill: Callable[[], Sequence[tuple[int, float]]]) -> None:
        """Called once at start-up, before any request, by engines that can time their
        model: ``measure_prefill()`` returns (tokens, seconds) prefill timings (it runs the
        model for about a second). A policy that prices a re-prefill calls it."""

    # -- order ----------------------------------------------------------------------------
    def job_arrival(self, request: RequestView) -> float:
        """First arrival of the request's job (a higher value is a newer job)."""
        return request.arrival_time

    def wait_bound(self, request: RequestView) -> float:
        """Seconds a waiting request may wait before it is served regardless of the job
        order (``queue_order == "job"``)."""
        return self.config.max_wait_s

    def victim_key(self, request: RequestView) -> Any | None:
        """Preemption order: the running request with the largest key goes first. None
        (the default): the engine's own order, the last admitted first."""
        return None

    # -- admission and memory pressure ----------------------------------------------------
    def may_admit(
        self, request: RequestView, new_tokens: int, free_tokens: int, now: float
    ) -> bool:
        """Whether the waiting request first in line may start now, needing ``new_tokens``
        of KV with ``free_tokens`` free (or evictable). False stops admission for this
        step (the queue's order says nothing behind it should go first). Default: yes."""
        return True

    def may_release_pins_for(
        self, request: RequestView, own_job_pinned: bool, num_running: int, now: float
    ) -> bool:
        """Whether ``request`` (waiting, out of memory) may take pinned memory.

        Pins are soft. Default: when its own job holds a pin (the pins exist to serve
        such turns), when nothing runs (else nothing would ever free memory), when it
        has waited longer than ``max_wait_s``, or at once when a CPU tier takes released
        pins (``pins_yield_to_tier``: the pinned job's next turn loads its context back
        in milliseconds, so holding other work back costs more than it saves). Released
        pins go newest job first."""
        return (
            own_job_pinned
            or (self.has_tier and self.config.pins_yield_to_tier)
            or num_running == 0
            or now - request.arrival_time > self.config.max_wait_s
        )

    def may_release_pin(self, requester: RequestView, pin_job_arrival: float, now: float) -> bool:
        """Whether ``requester`` (running or waiting, out of memory) may release the pin of
        the job that first arrived at ``pin_job_arrival`` (the newest pinned job is asked
        first). Default: yes."""
        return True

    # -- events ---------------------------------------------------------------------------
    def on_arrival(self, request: RequestView, now: float) -> None:
        """A request entered the scheduler (before it is queued)."""

    def on_scheduled(self, request: RequestView, hit: int, now: float) -> None:
        """A waiting request was admitted with ``hit`` of its tokens already in KV (pool or
        tier). Called before the pin its job may hold is released as a hit."""

    def on_finished(self, request: RequestView, now: float) -> FinishedAction:
        """A request stopped or hit its length limit: decide the fate of its blocks.

        Not called for aborted requests (always freed)."""
        return FREE

    def on_preempted(self, request: RequestView, now: float) -> None:
        """A running request was preempted (its blocks freed; it waits again)."""

    def on_aborted(self, request: RequestView, was_running: bool, now: float) -> None:
        """A request was aborted (its blocks freed); ``on_finished`` is not called."""

    def on_pinned(self, request: RequestView, now: float) -> None:
        """The scheduler placed the pin ``on_finished`` asked for."""

    def on_pin_released(self, request: RequestView, now: float, reason: str) -> None:
        """A pin placed on ``request``'s blocks ended (reason: ``PIN_RELEASE_*``)."""

    # -- metrics and lifetime ---------------------------------------------------------------
    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        """The series this policy exports; each reads the object ``make_stats`` returns.
        Declarations only: the engine's exporter creates and feeds the series."""
        return ()

    def make_stats(self) -> object | None:
        """The policy's own counters since the previous call (read by ``metrics()``), or
        None for a policy that has none."""
        return None

    def shutdown(self) -> None:
        """Flush anything the policy records (e.g. timestamp files)."""
