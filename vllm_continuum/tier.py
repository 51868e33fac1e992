"""How big a host-memory KV tier a policy that keeps jobs' contexts gets by default.

Both engines size the automatic tier by this one rule (``--kv-offloading-size`` unset and a
policy with ``Policy.wants_kv_tier``): ours from its KV cache once it is allocated
(``vllm.config.OffloadConfig``), upstream vLLM through the plugin from the device memory
its KV cache may take at most (``vllm_continuum.upstream.tier``).
"""

from __future__ import annotations

import os

# At the study's overload points a 4x tier no longer held a heavier sample's contexts, a
# 16x one did (docs/experiments.md); half the host memory leaves the rest to everything else.
AUTO_TIER_POOL_MULTIPLE = 16
AUTO_TIER_HOST_SHARE = 0.5


def available_host_memory() -> int:
    """Bytes of host memory available to a new allocation (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_tier_bytes(pool_bytes: int, available_bytes: int) -> int:
    """The automatic tier: ``AUTO_TIER_POOL_MULTIPLE`` x the KV cache (``pool_bytes``), at
    most ``AUTO_TIER_HOST_SHARE`` of the host memory available (``available_bytes``)."""
    if pool_bytes < 0 or available_bytes < 0:
        raise ValueError(f"negative memory: pool {pool_bytes}, available {available_bytes}")
    return min(pool_bytes * AUTO_TIER_POOL_MULTIPLE, int(available_bytes * AUTO_TIER_HOST_SHARE))
