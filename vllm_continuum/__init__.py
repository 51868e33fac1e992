"""Agent-aware scheduling decisions that import no serving engine.

Continuum (job-level order, KV pins with a TTL while a tool runs) and, next,
ContextServe's tool-time predictors live here once, so that every engine binding uses the
same decisions: our engine's policy seam (``vllm.v1.core.sched.policy``) and, later, a
plugin for upstream vLLM's scheduler. A binding translates its own request objects into
the plain values these classes take (job key, times, token counts, output text).

- ``tool_calls``: the tool call in a finished turn's text, and the tool's normalised name.
- ``estimator``: per-job arrival/departure bookkeeping, per-tool durations.
- ``ttl``: the paper's TTL rule as pure functions.
- ``job_order``: the job-level ordering keys (waiting order, preemption victim).
- ``continuum``: ``ContinuumCore``, the decisions of the Continuum policy.
- ``recorder``: the per-job event log (``scheduler_timestamps.json``).
- ``clock``: injected clocks (tests drive time by hand).
"""
