"""ContextServe as a policy: Continuum's order, victims, admission and pins, whose
finished-turn decision is ``ContextServeCore``'s three-way dispatch.

FAST -> ``Pin(ttl, strict=True)``; SLOW -> ``Offload`` when the engine has a CPU KV tier,
else ``Free``; UNCERTAIN -> Continuum's TTL (a soft ``Pin``) or ``Free``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm_continuum.clock import Clock
from vllm_continuum.context_serve.stats import CONTEXT_SERVE_METRICS, ContextServeStats
from vllm_continuum.metrics import MetricSpec
from vllm_continuum.policy.base import (
    FREE,
    FinishedAction,
    Offload,
    Pin,
    PolicySettings,
    RequestView,
)
from vllm_continuum.policy.continuum import ContinuumPolicy

if TYPE_CHECKING:
    from vllm_continuum.context_serve.core import ContextServeCore


class ContextServePolicy(ContinuumPolicy):
    name = "context_serve"

    @classmethod
    def from_settings(
        cls,
        settings: PolicySettings,
        decode: Callable[[Sequence[int]], str | None] | None,
        clock: Clock,
        has_kv_tier: bool,
    ) -> ContextServePolicy:
        if not has_kv_tier:  # no CPU tier: SLOW turns free their blocks
            settings = replace(
                settings, context_serve=replace(settings.context_serve, offload_slow=False)
            )
        return cls(settings, decode=decode, clock=clock, has_kv_tier=has_kv_tier)

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return CONTEXT_SERVE_METRICS

    def _make_core(self) -> ContextServeCore:
        # Imported here: the predictors pull in numpy and scipy, which a front end (it
        # reads ``metrics()``) does not need.
        from vllm_continuum.context_serve.core import ContextServeCore

        return ContextServeCore(
            self.config,
            self.clock,
            self.settings.context_serve,
            record_dir=self.settings.record_dir,
        )

    def on_finished(self, request: RequestView, now: float) -> FinishedAction:
        dispatch = self.core.decide(self.finished_turn(request, now))
        if dispatch.ttl_s > 0:
            return Pin(dispatch.ttl_s, strict=dispatch.strict)
        return Offload() if dispatch.offload else FREE

    def make_stats(self) -> ContextServeStats:
        return self.core.make_stats()
