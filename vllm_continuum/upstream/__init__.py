"""Our policies inside upstream vLLM: the glue between ``vllm_continuum`` and upstream's
scheduler (docs/upstream_plugin.md).

Only the modules of this subpackage import upstream's ``vllm``, and only when they are
imported themselves: ``vllm_continuum`` stays engine-agnostic, and installing the plugin
next to our own engine (never done: both are called ``vllm``) would import nothing.

- ``compat``: the tested upstream versions and the seams the glue relies on.
- ``request_info``: an upstream ``Request`` as the policies' ``RequestView`` (its job_id and
  is_last_step from ``vllm_xargs``).
- ``settings``: ``PolicyConfig`` from ``--additional-config '{"continuum": {...}}'``.
- ``queue``: the job-ordered waiting queue (an upstream ``RequestQueue``).
- ``pins``: the pin table (one pin per job, expiry and newest-job heaps).
- ``scheduler``: ``PolicyScheduler``, the mechanism over upstream's scheduler driving any
  registered policy (``ContinuumScheduler``, and ``context_serve.ContextServeScheduler``:
  fixed to one policy, for ``--scheduler-cls``).
- ``metrics``: the pin metrics at ``/metrics`` (a stat logger plugin).
- ``middleware``: top-level ``job_id`` / ``is_last_step`` moved into ``vllm_xargs``.
- ``cli``: the general plugin: ``--scheduling-policy <any registered policy>``.
"""

from __future__ import annotations

from collections.abc import Callable


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (loaded in every upstream process,
    before the CLI parser is built): offer our policies to ``--scheduling-policy``."""
    from vllm_continuum.upstream.cli import install

    install()


def stat_logger() -> Callable[..., object]:
    """Lazy accessor kept for symmetry; the entry point names the class directly."""
    from vllm_continuum.upstream.metrics import PinStatLogger

    return PinStatLogger
