"""Agent-aware scheduling decisions that import no serving engine.

Continuum (job-level order, KV pins with a TTL while a tool runs, job-level admission)
and ContextServe's tool-time predictors live here once, so that every engine binding uses
the same policies, decisions and mechanisms: our engine's scheduler (``vllm.v1.core.sched``)
and the plugin for upstream vLLM's scheduler (``vllm_continuum.upstream``) both build
their policy with ``policy.create_policy`` and hand it ``RequestView`` s of their own
requests; the mechanisms are subclassed with each engine's part.

- ``policy``: the policy seam (``Policy``, ``Free``/``Pin``/``Offload``, ``RequestView``),
  the registry and ``create_policy``, and the policies (fcfs, priority, continuum,
  context_serve).

- ``turns``: ``FinishedTurn``, the one record of a finished turn every binding reports.
- ``jobs``: the job-key rule (a non-empty ``job_id``, or the request is its own job).
- ``tool_calls``: the tool call in a finished turn's text, and the tool's normalised name.
- ``estimator``: per-job arrival/departure bookkeeping, per-tool durations.
- ``ttl``: the paper's TTL rule as pure functions.
- ``job_order``: the job-level ordering keys (waiting order, preemption victim).
- ``continuum``: ``ContinuumCore``, the decisions of the Continuum policy.
- ``admission``: ``JobAdmission``, job-level admission's memory accounting.
- ``context_serve``: ContextServe's predictors and ``ContextServeCore``.
- ``pins``: the pin mechanism (``PinTable``, ``PinManager``; the engine frees the blocks).
- ``queue``: ``JobOrderQueue``, the job-ordered waiting queue with bounded waiting.
- ``recorder``: the per-job event log (``scheduler_timestamps.json``).
- ``clock``: injected clocks (tests drive time by hand).
"""
