"""ContextServe on upstream vLLM: ``--scheduling-policy context_serve``, or
``--scheduler-cls vllm_continuum.upstream.context_serve.ContextServeScheduler``.

Continuum's glue (job order, job admission, victims, pins) whose finished-turn decision
is ``ContextServeCore``'s three-way dispatch: FAST -> a strict pin for the predicted tool
time; SLOW -> freed at once (the plugin has no CPU KV tier to offload to); UNCERTAIN ->
Continuum's TTL (a soft pin) or freed. Settings: ``--additional-config
'{"context_serve": {...}}'`` (``ContextServeConfig``'s fields) next to the shared
``"continuum"`` section. Needs scipy (and xgboost for the learned layer): the plugin's
``context-serve`` extra.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vllm.v1.request import Request
from vllm_continuum.config import PolicyConfig
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.context_serve.core import ContextServeCore
from vllm_continuum.upstream.request_info import RequestInfo
from vllm_continuum.upstream.scheduler import ContinuumScheduler
from vllm_continuum.upstream.settings import context_serve_config_from


class ContextServeScheduler(ContinuumScheduler):
    """``ContinuumScheduler`` with ``ContextServeCore``'s finished-turn decision."""

    def __init__(
        self, *args: Any, context_serve_config: ContextServeConfig | None = None, **kwargs: Any
    ) -> None:
        """``context_serve_config``: the predictor's settings (else read from
        ``additional_config``); the rest as ``AgentScheduler``."""
        self._cs_config = context_serve_config
        super().__init__(*args, **kwargs)

    def create_core(self, config: PolicyConfig) -> ContextServeCore:
        cs_config = self._cs_config or context_serve_config_from(self.vllm_config.additional_config)
        return ContextServeCore(
            config, self.clock, cs_config, record_dir=os.environ.get("RUN_OUTPUT_DIR")
        )

    def finished_pin(self, request: Request, info: RequestInfo, now: float) -> tuple[float, bool]:
        dispatch = self.core.decide(self._finished_turn(request, info, now))
        return dispatch.ttl_s, dispatch.strict  # SLOW: ttl 0, freed (no offload tier)

    def make_stats(self, *args: Any, **kwargs: Any):
        # The verdict counters are deltas for a metrics exporter; the plugin exports none
        # yet, so they are drained here (else they would grow without bound).
        self.core.make_stats()
        return super().make_stats(*args, **kwargs)


class AsyncContextServeScheduler(ContextServeScheduler, AsyncScheduler):
    """``ContextServeScheduler`` with upstream's async scheduling (chosen by the CLI)."""
