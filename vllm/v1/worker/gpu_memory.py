"""Sizing the KV cache from live GPU memory under ``--gpu-memory-utilization``, as vLLM's
GPU worker does (its ``determine_available_memory``).

``gpu_memory_utilization`` is this engine's share of the device: ``requested = total *
utilization`` bytes, whatever other processes hold (the device must have that much free
when the engine starts). The KV cache gets what the engine does not otherwise need::

    kv = requested - consumed - activation_peak
    consumed        = free at start - free after loading and profiling (caches emptied):
                      weights, plus non-torch memory (cuBLAS workspaces, ...)
    activation_peak = torch's allocated peak during the profile step - allocated after it

Only live allocations count: what the caching allocator holds but no tensor uses (e.g. the
staging of a load) is returned by ``empty_cache`` before measuring. The profile step is the
largest the scheduler can send (``ModelRunner.profile_run``).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

GiB = 1 << 30


@dataclass(frozen=True)
class MemorySnapshot:
    """One device's memory at a moment, in bytes."""

    free: int  # cudaMemGetInfo: free on the device (all processes)
    total: int
    torch_allocated: int  # live tensors of this process (allocated_bytes.all.current)
    torch_peak: int  # their peak since the last reset (allocated_bytes.all.peak)
    torch_reserved: int  # held by this process's caching allocator

    @classmethod
    def measure(cls, device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)
        return cls(
            free=free,
            total=total,
            torch_allocated=stats.get("allocated_bytes.all.current", 0),
            torch_peak=stats.get("allocated_bytes.all.peak", 0),
            torch_reserved=torch.cuda.memory_reserved(device),
        )

    @property
    def non_torch(self) -> int:
        """Device memory in use that torch's allocator does not hold (other processes,
        contexts, library workspaces)."""
        return self.total - self.free - self.torch_reserved


@dataclass(frozen=True)
class KVCacheBudget:
    """The arithmetic of one sizing (bytes), for the start-up log and the tests."""

    requested: int  # total * gpu_memory_utilization
    consumed: int  # free at start - free after profiling
    activation_peak: int  # transient peak of the profile step
    weights: int  # torch allocations made while loading (part of consumed)
    non_torch_increase: int  # non-torch memory this engine added (part of consumed)

    @property
    def kv_cache_bytes(self) -> int:
        return self.requested - self.consumed - self.activation_peak

    def describe(self) -> str:
        return (
            f"{self.requested / GiB:.2f} GiB requested = {self.kv_cache_bytes / GiB:.2f} KV "
            f"+ {self.weights / GiB:.2f} weights + {self.activation_peak / GiB:.2f} peak "
            f"activations + {(self.consumed - self.weights) / GiB:.2f} other "
            f"(non-torch {self.non_torch_increase / GiB:.2f})"
        )


def measure_before_load(device: torch.device) -> MemorySnapshot:
    """The baseline, taken before the model is loaded (caches emptied first)."""
    gc.collect()
    torch.cuda.empty_cache()
    return MemorySnapshot.measure(device)


def requested_memory(start: MemorySnapshot, utilization: float) -> int:
    """``total * utilization``; ValueError when the device had less free at start."""
    requested = math.ceil(start.total * utilization)
    if start.free < requested:
        raise ValueError(
            f"gpu_memory_utilization {utilization} asks for {requested / GiB:.2f} GiB of "
            f"the device's {start.total / GiB:.2f} GiB, but only {start.free / GiB:.2f} GiB "
            "were free when the engine started (other processes hold the rest): lower "
            "--gpu-memory-utilization or set --kv-cache-memory"
        )
    return requested


def profile_kv_cache_budget(
    device: torch.device,
    utilization: float,
    start: MemorySnapshot,
    profile_step: Callable[[], object],
) -> KVCacheBudget:
    """Run ``profile_step`` (a forward of the largest step, after the weights are loaded)
    and size the KV cache from ``start`` (``measure_before_load``) and what it used."""
    requested = requested_memory(start, utilization)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    loaded = MemorySnapshot.measure(device)
    profile_step()
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    after = MemorySnapshot.measure(device)
    return KVCacheBudget(
        requested=requested,
        consumed=start.free - after.free,
        activation_peak=max(after.torch_peak - after.torch_allocated, 0),
        weights=loaded.torch_allocated - start.torch_allocated,
        non_torch_increase=after.non_torch - start.non_torch,
    )
