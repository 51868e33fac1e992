"""The automatic host-memory KV tier on upstream vLLM, and whether the engine has one.

Upstream's own KV offloading (``--kv-offloading-size``, the ``native`` backend: its
``OffloadingConnector``) is the tier: it copies every computed block to host memory and
loads a later prefix hit back. So on upstream a pin that ends, a pin released under
pressure and an ``Offload`` all reach the tier the same way, by freeing the blocks: the
connector saved them already. The plugin gives the policies that keep jobs' contexts
(``Policy.wants_kv_tier``: continuum, context_serve) the tier our engine gives them:

- ``--kv-offloading-size`` unset: a tier sized by ``vllm_continuum.tier`` from the most
  device memory the KV cache can take (``--kv-cache-memory-bytes`` if set, else the
  device's memory x ``--gpu-memory-utilization``: the cache itself is sized later, in the
  engine process) and the host memory available now;
- ``--kv-offloading-size 0``: no tier (upstream alone would try a tier of 0 bytes);
- where upstream cannot offload (its CPU build: "CPU Offloading is currently only
  supported on CUDA-alike and XPU GPUs") the policy runs without one, and says so.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_continuum.policy.registry import get_policy_class
from vllm_continuum.tier import auto_tier_bytes, available_host_memory

logger = logging.getLogger(__name__)

# Upstream's connectors that put the KV cache's blocks in host memory (``native`` backend).
OFFLOADING_CONNECTORS = frozenset({"OffloadingConnector", "SimpleCPUOffloadConnector"})


def offloading_unsupported() -> str | None:
    """Why upstream cannot offload KV on this platform, or None when it can."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() or current_platform.is_xpu():
        return None
    return (
        "upstream vLLM offloads KV to host memory only from CUDA-alike and XPU devices "
        f"(this one: {current_platform.device_type})"
    )


def kv_budget_bytes(engine_args: Any) -> int:
    """The most device memory the KV cache can take: ``kv_cache_memory_bytes`` when given,
    else the device's memory x ``gpu_memory_utilization``."""
    explicit = getattr(engine_args, "kv_cache_memory_bytes", None)
    if explicit:
        return int(explicit)
    from vllm.platforms import current_platform

    return int(current_platform.get_device_total_memory() * engine_args.gpu_memory_utilization)


def configure_tier(engine_args: Any, policy_name: str) -> None:
    """Set ``engine_args.kv_offloading_size`` for ``policy_name`` (see the module doc)."""
    size = engine_args.kv_offloading_size
    if size == 0:
        engine_args.kv_offloading_size = None  # off, as in our engine
        logger.info("--kv-offloading-size 0: no host KV tier")
        return
    if size is not None or not get_policy_class(policy_name).wants_kv_tier:
        return
    if engine_args.enable_prefix_caching is False:
        return  # the tier finds blocks by their prefix hash
    if getattr(engine_args, "kv_offloading_backend", "native") != "native":
        return  # e.g. LMCache sizes its own store
    why_not = offloading_unsupported()
    if why_not is not None:
        logger.info("scheduling policy %s runs without a host KV tier: %s", policy_name, why_not)
        return
    size_bytes = auto_tier_bytes(kv_budget_bytes(engine_args), available_host_memory())
    if size_bytes <= 0:
        return
    engine_args.kv_offloading_size = size_bytes / 2**30
    logger.info(
        "host KV tier sized for policy %s: %.2f GiB (--kv-offloading-size 0 turns it off)",
        policy_name,
        engine_args.kv_offloading_size,
    )


def has_kv_tier(vllm_config: Any) -> bool:
    """Whether upstream's engine was configured with a host-memory KV tier."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return transfer is not None and getattr(transfer, "kv_connector", None) in OFFLOADING_CONNECTORS
