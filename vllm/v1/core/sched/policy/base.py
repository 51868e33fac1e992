"""The policy seam: every scheduling decision that differs between policies.

The scheduler never branches on the policy name. It asks its ``Policy`` at these
points (ARCHITECTURE.md, "Policies"):

1. which waiting request next: the ``RequestQueue`` from ``create_request_queue``;
2. which running request to preempt: ``select_victim``;
3. what to do with a finished request's blocks: ``on_finished`` -> ``Free`` /
   ``Pin(ttl_s)`` / ``Offload``;
4. observers: ``on_arrival``, ``on_scheduled``, ``on_pin_released``.

Policies own no KV blocks; the pin/expiry/release mechanism lives in the scheduler.
Policies take time only from the ``now`` arguments (the scheduler's injected clock),
so they are unit-testable with a fake clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.config import PolicyConfig

if TYPE_CHECKING:
    from vllm.v1.core.sched.request_queue import RequestQueue
    from vllm.v1.request import Request


@dataclass(frozen=True)
class Free:
    """Release the finished request's blocks now (they stay prefix-cached until evicted)."""


@dataclass(frozen=True)
class Pin:
    """Keep the finished request's blocks referenced for ``ttl_s`` seconds."""

    ttl_s: float

    def __post_init__(self) -> None:
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s!r}")


@dataclass(frozen=True)
class Offload:
    """Copy the blocks to the CPU tier, then free them (needs an offload tier)."""


FinishedAction = Free | Pin | Offload
FREE = Free()

# Why a pin ended (argument of ``on_pin_released``).
PIN_RELEASE_HIT = "hit"  # the job's next turn took its prefix hit
PIN_RELEASE_EXPIRED = "expired"  # the TTL passed and the job had nothing waiting
PIN_RELEASE_PRESSURE = "pressure"  # memory was needed by someone else
PIN_RELEASE_REPLACED = "replaced"  # the job pinned a newer request
PIN_RELEASE_SHUTDOWN = "shutdown"


class Policy(ABC):
    """Base class of scheduling policies. Defaults are plain vLLM behaviour."""

    name: str = "base"

    def __init__(
        self,
        config: PolicyConfig | None = None,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.config = config or PolicyConfig()
        # Token ids -> text, for policies that read finished outputs (tool calls).
        self.decode = decode

    @abstractmethod
    def create_request_queue(self) -> RequestQueue:
        """The waiting queue; its pop order is this policy's admission order."""

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when memory runs out (default: last admitted).

        ``running`` is in admission order and is never empty.
        """
        return running[-1]

    def on_arrival(self, request: Request, now: float) -> None:
        """A request entered the engine (before it is queued)."""

    def on_scheduled(self, request: Request, now: float) -> None:
        """A waiting request was admitted; ``request.num_cached_tokens`` holds its hit."""

    def on_finished(self, request: Request, now: float) -> FinishedAction:
        """A request stopped or hit its length limit: decide the fate of its blocks.

        Not called for aborted requests (always freed).
        """
        return FREE

    def on_pin_released(self, request: Request, now: float, reason: str) -> None:
        """A pin placed on ``request``'s blocks ended (reason: ``PIN_RELEASE_*``)."""

    def shutdown(self) -> None:
        """Flush anything the policy records (e.g. timestamp files)."""
