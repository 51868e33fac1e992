"""ContextServe on upstream vLLM, for ``--scheduler-cls
vllm_continuum.upstream.context_serve.ContextServeScheduler`` (``--scheduling-policy
context_serve`` uses ``PolicyScheduler`` with the name).

The policy is ``vllm_continuum.policy.context_serve.ContextServePolicy``, the same object
our engine runs: FAST -> a strict pin for the predicted tool time; SLOW -> freed at once
(the plugin has no CPU KV tier to offload to); UNCERTAIN -> Continuum's TTL (a soft pin)
or freed. Settings: ``--additional-config '{"context_serve": {...}}'``
(``ContextServeConfig``'s fields) next to the shared ``"continuum"`` section. Needs scipy
(and xgboost for the learned layer): the plugin's ``context-serve`` extra.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from vllm_continuum.upstream.scheduler import PolicyScheduler


class ContextServeScheduler(PolicyScheduler):
    """``PolicyScheduler`` fixed to the ``context_serve`` policy."""

    policy_name = "context_serve"


class AsyncContextServeScheduler(ContextServeScheduler, AsyncScheduler):
    """``ContextServeScheduler`` with upstream's async scheduling (chosen by the CLI)."""
