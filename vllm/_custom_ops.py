"""Native kernels with pure-torch fallbacks.

``reshape_and_cache`` writes this step's K/V into their paged slots. The native version
(csrc/cpu/cache_kernels.cpp) is used when it has been built — by CMake into
``vllm/_C.so`` or by ``python -m vllm._custom_ops --build`` into the cache folder —
and the pure-torch version otherwise. Both give bit-identical caches.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from vllm import envs

logger = logging.getLogger(__name__)

_SRC = Path(__file__).resolve().parent.parent / "csrc" / "cpu" / "cache_kernels.cpp"
_native = None  # the torch op once loaded, else None
_tried = False


def _cache_dir() -> Path:
    return Path(envs.VLLM_CACHE_ROOT) / "kernels"


def _load_native():
    global _native, _tried
    if _tried:
        return _native
    _tried = True
    for lib in (Path(__file__).with_name("_C.so"), _cache_dir() / "vllm_continuum_C.so"):
        if lib.exists():
            try:
                torch.ops.load_library(str(lib))
                _native = torch.ops.vllm_continuum_C.reshape_and_cache
                logger.info("Using native KV kernels from %s", lib)
                break
            except (OSError, RuntimeError) as e:  # stale build for another torch
                logger.warning("Ignoring native kernels at %s: %s", lib, e)
    return _native


def build(verbose: bool = False) -> Path:
    """JIT-compile the native kernels into the cache folder (needs a C++ compiler)."""
    from torch.utils.cpp_extension import load

    out = _cache_dir()
    out.mkdir(parents=True, exist_ok=True)
    load(
        name="vllm_continuum_C",
        sources=[str(_SRC)],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        is_python_module=False,
        verbose=verbose,
    )
    global _tried
    _tried = False
    return out / "vllm_continuum_C.so"


def reshape_and_cache_torch(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Pure-torch version. key/value: (num_tokens, kv_heads, head_size); slots int64."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat = kv_cache.view(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write K/V of each token into ``kv_cache[:, slot // bs, slot % bs]`` (slot < 0: skip)."""
    native = _load_native() if kv_cache.device.type == "cpu" else None
    if native is not None:
        native(key, value, kv_cache, slot_mapping)
    else:
        reshape_and_cache_torch(key, value, kv_cache, slot_mapping)


def has_native_kernels() -> bool:
    return _load_native() is not None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the optional native kernels.")
    parser.add_argument("--build", action="store_true", help="JIT-compile csrc/ now")
    args = parser.parse_args()
    if args.build:
        print(f"built {build(verbose=True)}")
    print(f"native kernels available: {has_native_kernels()}")
