"""ContextServe in this engine: Continuum's binding (queue, victims, last-step protection,
pins) whose finished-turn decision is ``ContextServeCore``'s three-way dispatch.

FAST -> ``Pin(ttl, strict=True)``; SLOW -> ``Offload`` when the engine has a CPU KV
tier, else ``Free``; UNCERTAIN -> Continuum's TTL (a soft ``Pin``) or ``Free``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from vllm import envs
from vllm.config import PolicyConfig, VllmConfig
from vllm.utils.clock import Clock, monotonic_clock
from vllm.v1.core.sched.policy.base import FREE, FinishedAction, Offload, Pin
from vllm.v1.core.sched.policy.continuum import ContinuumPolicy
from vllm.v1.request import Request
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.stats import CONTEXT_SERVE_METRICS, ContextServeStats
from vllm_continuum.metrics import MetricSpec

if TYPE_CHECKING:
    from vllm_continuum.context_serve.core import ContextServeCore


class ContextServePolicy(ContinuumPolicy):
    name = "context_serve"

    def __init__(
        self,
        config: PolicyConfig | None = None,
        decode: Callable[[list[int]], str] | None = None,
        clock: Clock = monotonic_clock,
        has_kv_tier: bool = False,
        context_serve_config: ContextServeConfig | None = None,
    ) -> None:
        """``context_serve_config``: the predictor's settings (defaults if None).
        ValueError on unusable rules/model files."""
        self.context_serve_config = context_serve_config or ContextServeConfig()
        super().__init__(config, decode, clock, has_kv_tier)

    @classmethod
    def from_config(
        cls, vllm_config: VllmConfig, decode, clock: Clock, has_kv_tier: bool
    ) -> ContextServePolicy:
        cs_config = vllm_config.context_serve_config
        if not has_kv_tier:
            cs_config = replace(cs_config, offload_slow=False)  # no CPU tier: SLOW frees
        return cls(
            vllm_config.policy_config,
            decode=decode,
            clock=clock,
            has_kv_tier=has_kv_tier,
            context_serve_config=cs_config,
        )

    @classmethod
    def metrics(cls) -> tuple[MetricSpec, ...]:
        return CONTEXT_SERVE_METRICS

    def _make_core(self) -> ContextServeCore:
        # Imported here: the predictors pull in numpy and scipy, which the front end (it
        # reads ``metrics()``) does not need.
        from vllm_continuum.context_serve.core import ContextServeCore

        return ContextServeCore(
            self.config, self.clock, self.context_serve_config, record_dir=envs.RUN_OUTPUT_DIR
        )

    def on_finished(self, request: Request, now: float) -> FinishedAction:
        dispatch = self.core.decide(self._finished_turn(request, now))
        if dispatch.ttl_s > 0:
            return Pin(dispatch.ttl_s, strict=dispatch.strict)
        return Offload() if dispatch.offload else FREE

    def make_stats(self) -> ContextServeStats:
        return self.core.make_stats()
