"""The policy seam: every scheduling decision that differs between policies.

The scheduler never branches on the policy name. It asks its ``Policy`` at these
points (docs/design.md, "Scheduler"):

1. which waiting request next: the ``RequestQueue`` from ``create_request_queue``;
2. which running request to preempt: ``select_victim``;
3. what to do with a finished request's blocks: ``on_finished`` -> ``Free`` /
   ``Pin(ttl_s)`` / ``Offload``;
4. whether a waiting request that does not fit may take pinned memory:
   ``may_release_pins_for``;
5. observers: ``on_arrival``, ``on_scheduled``, ``on_pinned``, ``on_pin_released``.

A policy's own metrics are data: ``metrics()`` declares its series (``MetricSpec`` s,
``vllm_continuum.metrics``) and ``make_stats`` reports the object they read; the engine's
exporter builds and feeds them without knowing the policy.

Policies own no KV blocks and keep no copy of the scheduler's state: the pins (and so
which jobs hold pinned blocks) belong to the scheduler's ``KVCachePinManager``
(``sched/pinned.py``), which hands the policy a read-only view of the pinned jobs. Policies
take time only from the ``now`` arguments and the injected clock, so they are
unit-testable with a fake clock. Engine-agnostic decisions (tool calls, tool times, TTL,
job order) live in the ``vllm_continuum`` package; a policy here is their binding to this
engine's ``Request``.

Contract on finished requests: ``on_finished`` is called for every request that stops
inside the engine (EOS, stop token, ``max_tokens``, length cap); aborted requests are
always freed and skip it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.config import PolicyConfig
from vllm_continuum.clock import Clock, monotonic_clock
from vllm_continuum.metrics import MetricSpec

# Why a pin ended (argument of ``on_pin_released``): defined with the pin mechanism.
from vllm_continuum.pins import (  # noqa: F401 - re-exported for policies
    PIN_RELEASE_EXPIRED,
    PIN_RELEASE_HIT,
    PIN_RELEASE_PRESSURE,
    PIN_RELEASE_REPLACED,
    PIN_RELEASE_SHUTDOWN,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.request_queue import RequestQueue
    from vllm.v1.request import Request


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
    """Copy the blocks to the CPU tier, then free them (needs an offload tier)."""


FinishedAction = Free | Pin | Offload
FREE = Free()


class Policy(ABC):
    """Base class of scheduling policies. Defaults are plain vLLM behaviour.

    Subclasses register under a name in ``policy/registry.py``; ``create_policy`` builds
    every policy the same way: ``from_config`` with the engine's facts (``has_kv_tier``).
    """

    name: str = "base"
    # Whether the policy reads finished outputs as text (then ``decode`` is required).
    needs_decode: bool = False

    def __init__(
        self,
        config: PolicyConfig | None = None,
        decode: Callable[[list[int]], str] | None = None,
        clock: Clock = monotonic_clock,
        has_kv_tier: bool = False,
    ) -> None:
        """``has_kv_tier``: whether the engine saves freed and released blocks in a CPU KV
        tier (an engine fact, derived once by the engine core)."""
        self.config = config or PolicyConfig()
        # Token ids -> text, for policies that read finished outputs (tool calls).
        self.decode = decode
        self.clock = clock
        self.has_tier = has_kv_tier

    @classmethod
    def from_config(
        cls,
        vllm_config: VllmConfig,
        decode: Callable[[list[int]], str] | None,
        clock: Clock,
        has_kv_tier: bool,
    ) -> Policy:
        """Build from the engine's config (a policy with settings of its own reads them
        here) and facts; ``create_policy`` calls this for every policy."""
        return cls(vllm_config.policy_config, decode=decode, clock=clock, has_kv_tier=has_kv_tier)

    @abstractmethod
    def create_request_queue(self, pinned_jobs: Container[str]) -> RequestQueue:
        """The waiting queue; its pop order is this policy's admission order.

        ``pinned_jobs`` is the scheduler's live view of the jobs holding pinned blocks
        (read-only; ``on_pinned``/``on_pin_released`` say when it changes)."""

    def prepare(self, measure_prefill: Callable[[], Sequence[tuple[int, float]]]) -> None:
        """Called once at start-up, before any request. ``measure_prefill()`` returns
        (tokens, seconds) prefill timings (it runs the model for about a second): a policy
        that prices a re-prefill calls it, the others do not."""

    def job_arrival(self, request: Request) -> float:
        """First arrival of the request's job (a higher value is a newer job)."""
        return request.arrival_time

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when memory runs out (default: last admitted).

        ``running`` is in admission order and is never empty.
        """
        return running[-1]

    def may_release_pins_for(
        self, request: Request, own_job_pinned: bool, num_running: int, now: float
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

    def may_admit(self, request: Request, new_tokens: int, free_tokens: int, now: float) -> bool:
        """Whether the waiting request first in line may start now, needing ``new_tokens``
        of KV with ``free_tokens`` free (or evictable). False stops admission for this
        step (the queue's order says nothing behind it should go first). Default: yes."""
        return True

    def may_release_pin(self, requester: Request, pin_job_arrival: float, now: float) -> bool:
        """Whether ``requester`` (running or waiting, out of memory) may release the pin of
        the job that first arrived at ``pin_job_arrival`` (the newest pinned job is asked
        first). Default: yes."""
        return True

    def on_arrival(self, request: Request, now: float) -> None:
        """A request entered the engine (before it is queued)."""

    def on_scheduled(self, request: Request, now: float) -> None:
        """A waiting request was admitted; ``request.num_cached_tokens`` holds its hit.
        Called before the pin its job may hold is released as a hit."""

    def on_finished(self, request: Request, now: float) -> FinishedAction:
        """A request stopped or hit its length limit: decide the fate of its blocks.

        Not called for aborted requests (always freed).
        """
        return FREE

    def on_preempted(self, request: Request, now: float) -> None:
        """A running request was preempted (its blocks freed; it waits again)."""

    def on_aborted(self, request: Request, was_running: bool, now: float) -> None:
        """A request was aborted (its blocks freed); ``on_finished`` is not called."""

    def on_pinned(self, request: Request, now: float) -> None:
        """The scheduler placed the pin ``on_finished`` asked for."""

    def on_pin_released(self, request: Request, now: float, reason: str) -> None:
        """A pin placed on ``request``'s blocks ended (reason: ``PIN_RELEASE_*``)."""

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        """The series this policy exports; each reads the object ``make_stats`` returns.
        Declarations only: the engine's exporter creates and feeds the series."""
        return ()

    def make_stats(self) -> object | None:
        """The policy's own counters since the previous call (``SchedulerStats.
        policy_stats``, read by ``metrics()``), or None for a policy that has none."""
        return None

    def shutdown(self) -> None:
        """Flush anything the policy records (e.g. timestamp files)."""
