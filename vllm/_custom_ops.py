"""Native kernels with pure-torch fallbacks.

``reshape_and_cache`` writes this step's K/V into their paged slots (csrc/cpu/cache_kernels.cpp);
``ggml_linear`` / ``ggml_dequantize`` multiply by / expand GGUF-quantized weights
(csrc/cpu/quant_kernels.cpp). The native versions are used when they have been built — by
CMake into ``vllm/_C.so`` or by ``python -m vllm._custom_ops --build`` into the cache
folder — and the pure-torch versions otherwise. The KV writes are bit-identical; the
quantized linear agrees up to float rounding (another summation order).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import shutil
import subprocess
from pathlib import Path

import torch

from vllm import envs

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc" / "cpu"
_SOURCES = [_CSRC / "cache_kernels.cpp", _CSRC / "quant_kernels.cpp"]
_native = None  # the torch op once loaded, else None
_tried = False


def _cache_dir() -> Path:
    return Path(envs.VLLM_CACHE_ROOT) / "kernels"


def _jit_name() -> str:
    """The JIT library's name carries a hash of the sources, so a build cached from older
    sources (without today's ops) is never loaded in place of the current one."""
    h = hashlib.sha256()
    for src in _SOURCES:
        h.update(src.read_bytes() if src.exists() else b"")
    return f"vllm_continuum_C_{h.hexdigest()[:12]}"


def _load_native():
    global _native, _tried
    if _tried:
        return _native
    _tried = True
    for lib in (Path(__file__).with_name("_C.so"), _cache_dir() / f"{_jit_name()}.so"):
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
        name=_jit_name(),
        sources=[str(src) for src in _SOURCES],
        extra_cflags=["-O3", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(out),
        is_python_module=False,
        verbose=verbose,
    )
    global _tried
    _tried = False
    return out / f"{_jit_name()}.so"


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


# -- GGUF-quantized weights ------------------------------------------------------------------
# GGML type ids (gguf.GGMLQuantizationType) -> bytes per block of 32 weights.
GGML_Q4_1 = 3
GGML_Q8_0 = 8
GGML_BLOCK_BYTES = {GGML_Q4_1: 20, GGML_Q8_0: 34}
GGML_BLOCK_WEIGHTS = 32


def _quant_ops():
    """torch.ops.vllm_continuum_C when its build has the quantized kernels, else None
    (a library built before they existed has only reshape_and_cache)."""
    if _load_native() is None:
        return None
    lib = torch.ops.vllm_continuum_C
    return lib if hasattr(lib, "ggml_linear") else None


def has_quant_kernels() -> bool:
    return _quant_ops() is not None


def ensure_quant_kernels() -> bool:
    """The quantized kernels, JIT-built once into the cache folder when missing and a C++
    compiler exists (about a minute, then cached); False means the fallback runs."""
    if has_quant_kernels():
        return True
    if _native is not None:  # an older build is loaded: it cannot be replaced in-process
        logger.warning(
            "Native kernels lack the quantized ops: rebuild them with "
            "`python -m vllm._custom_ops --build` and restart"
        )
        return False
    if shutil.which("c++") is None:
        return False
    logger.info("Building the native kernels (one time, about a minute)...")
    try:
        build()
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        logger.warning("Building the native kernels failed: %s", e)
        return False
    return has_quant_kernels()


def ggml_dequantize_torch(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """uint8 (N, blocks * block_bytes) -> fp32 (N, blocks * 32), computed as gguf-py does
    (q * d, then + m), so it equals the fp32 weights transformers converts a GGUF into."""
    if qtype not in GGML_BLOCK_BYTES:
        raise ValueError(f"unsupported GGML type {qtype} (supported: Q4_1=3, Q8_0=8)")
    n = qweight.shape[0]
    blocks = qweight.view(n, -1, GGML_BLOCK_BYTES[qtype])  # (N, nb, block_bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # (N, nb, 1)
    if qtype == GGML_Q8_0:
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, -1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float()
    qs = blocks[..., 4:]  # byte j: weight j (low nibble), weight j + 16 (high nibble)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()
    return (q * d + m).reshape(n, -1)


def ggml_dequantize(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The fp32 weight matrix of GGUF blocks; native and fallback are bit-identical."""
    ops = _quant_ops()
    if ops is not None:
        return ops.ggml_dequantize(qweight, qtype)
    return ggml_dequantize_torch(qweight, qtype)


def ggml_linear_torch(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """Pure-torch reference: dequantize, then a dense matmul. x: (M, K) -> (M, N)."""
    return torch.nn.functional.linear(x, ggml_dequantize_torch(qweight, qtype))


def ggml_linear(
    x: torch.Tensor, qweight: torch.Tensor, qtype: int, dense_min_tokens: int = 32
) -> torch.Tensor:
    """``x @ W.T`` for GGUF-quantized W; x: (M, K) fp32. Up to ``dense_min_tokens`` rows the
    native kernel reads the blocks directly (decode: bound by weight bytes); from there on a
    dequantized dense GEMM is faster (prefill: bound by arithmetic)."""
    ops = _quant_ops()
    if ops is None:
        return ggml_linear_torch(x, qweight, qtype)
    if x.shape[0] >= dense_min_tokens:
        return torch.nn.functional.linear(x, ops.ggml_dequantize(qweight, qtype))
    return ops.ggml_linear(x, qweight, qtype)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build the optional native kernels.")
    parser.add_argument("--build", action="store_true", help="JIT-compile csrc/ now")
    args = parser.parse_args()
    if args.build:
        print(f"built {build(verbose=True)}")
    print(f"native kernels available: {has_native_kernels()}")
    print(f"native quantized kernels available: {has_quant_kernels()}")
