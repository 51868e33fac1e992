"""Environment variables that vllm-continuum reads: each declared once, with its default.

Read lazily: ``envs.VLLM_CPU_THREADS`` looks the variable up on every access (module
``__getattr__``), so a variable set after import (a test, a parent before it spawns the
engine) takes effect, and importing this module reads nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_CACHE_ROOT: str
    VLLM_ATTENTION_BACKEND: str | None
    VLLM_CUDA_DECODE_ATTENTION: str
    VLLM_CUDA_FUSED_OPS: bool
    VLLM_MXFP4_MOE: str
    VLLM_TOP_P_METHOD: str
    VLLM_CPU_THREADS: int
    VLLM_DP_RANK: int
    VLLM_DP_PINNED_WEIGHT: float
    VLLM_CPU_ENGINE_NICE: int
    VLLM_ENGINE_ORPHAN_GRACE_S: float
    VLLM_CPU_GGUF_PREFILL_DTYPE: str
    VLLM_CPU_GGUF_DECODE_ACT: str
    VLLM_USE_UVLOOP: bool
    VLLM_LOG_STATS_INTERVAL: float
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: bool
    VLLM_SERVER_DEV_MODE: bool
    VLLM_GC_DEBUG: str | None
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: bool
    VLLM_LOGGING_LEVEL: str
    VLLM_IMAGE_FETCH_TIMEOUT: float
    GOMP_SPINCOUNT: str | None
    OMP_WAIT_POLICY: str | None
    RUN_OUTPUT_DIR: str | None


def _cache_root() -> str:
    xdg = os.getenv("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.getenv("VLLM_CACHE_ROOT") or os.path.join(xdg, "vllm-continuum")


def _upper_or_none(name: str) -> Callable[[], str | None]:
    return lambda: (os.getenv(name) or "").strip().upper() or None


def _choice(name: str, choices: tuple[str, ...]) -> Callable[[], str]:
    """One of ``choices`` (case-insensitive; unset or empty: the first); anything else
    raises a ValueError naming the variable."""

    def read() -> str:
        value = (os.getenv(name) or "").strip().lower() or choices[0]
        if value not in choices:
            raise ValueError(f"{name}={os.getenv(name)!r}: expected one of {', '.join(choices)}")
        return value

    return read


def _positive_seconds(name: str, default: float) -> Callable[[], float]:
    """A positive finite number of seconds (unset or empty: ``default``); anything else
    raises a ValueError naming the variable."""

    def read() -> float:
        text = (os.getenv(name) or "").strip()
        try:
            value = float(text) if text else default
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise ValueError(f"{name}={os.getenv(name)!r}: expected a positive number of seconds")
        return value

    return read


environment_variables: dict[str, Callable[[], Any]] = {
    # Root of our caches: GGUF models converted to safetensors (models/) and the
    # JIT-built native kernels (kernels/). Default: $XDG_CACHE_HOME/vllm-continuum,
    # else ~/.cache/vllm-continuum.
    "VLLM_CACHE_ROOT": _cache_root,
    # Force an attention backend: a name of vllm/v1/attention/backends/registry.py, e.g.
    # TORCH_SDPA or FLASH_ATTN (case-insensitive); unset: the highest-priority registered
    # backend that can run, i.e. flash-attn on CUDA when it can, torch otherwise.
    "VLLM_ATTENTION_BACKEND": _upper_or_none("VLLM_ATTENTION_BACKEND"),
    # Kernel of TORCH_FLASH_ATTN's decode rows (one new token over a cached context):
    # auto = the Triton paged decode kernel (backends/triton_decode.py: reads the cache in
    # place, fixed grid, CUDA-graph capturable) when triton imports and the device is CUDA,
    # else varlen_attn; triton (fail at start-up where it cannot run); varlen (every row
    # through torch's varlen_attn, as prefill rows always are). Read when the backend is
    # built. Which is faster on a given GPU is unmeasured: choose by measurement.
    "VLLM_CUDA_DECODE_ATTENTION": _choice(
        "VLLM_CUDA_DECODE_ATTENTION", ("auto", "triton", "varlen")
    ),
    # CUDA: the Llama family's norms, rotary embedding and SiLU-and-mul as one Triton
    # kernel each (model_executor/layers/triton_ops.py) where triton imports; 0: pure
    # torch (several kernels each), to compare. Read once, at the first such op.
    "VLLM_CUDA_FUSED_OPS": lambda: os.getenv("VLLM_CUDA_FUSED_OPS", "1") != "0",
    # gpt-oss's MXFP4 experts: auto = kept packed as the checkpoint stores them and run by
    # the Triton kernel of model_executor/layers/triton_mxfp4_moe.py where triton imports
    # and CUDA is available (about a fourth of bf16's bytes), else expanded to the model's
    # dtype at load; dequantize = always expanded (the bf16 grouped GEMM), to compare.
    # Read when the model is built.
    "VLLM_MXFP4_MOE": _choice("VLLM_MXFP4_MOE", ("auto", "dequantize")),
    # How top-p finds each row's nucleus (vllm/v1/sample/sampler.py, apply_top_p): auto =
    # numpy's ranking of the probabilities on a CPU, torch.sort elsewhere; numpy; sort;
    # triton (a search over the probabilities' bits, vllm/v1/sample/triton_top_p.py: CUDA
    # tensors, no sort; to be timed against sort on a GPU before it becomes the default).
    "VLLM_TOP_P_METHOD": _choice("VLLM_TOP_P_METHOD", ("auto", "numpy", "sort", "triton")),
    # torch intra-op threads of the CPU model runner. Default: every core.
    "VLLM_CPU_THREADS": lambda: int(os.getenv("VLLM_CPU_THREADS") or os.cpu_count() or 1),
    # An engine process's data-parallel rank (--data-parallel-size; set by the front end
    # for each engine it starts). Default 0.
    "VLLM_DP_RANK": lambda: int(os.getenv("VLLM_DP_RANK") or 0),
    # What a job whose KV an engine pins (its tool runs; its next turn will come back to
    # that engine) weighs in the engine's load when the data-parallel front end places a
    # new job, against 1 for a running request; 0: vLLM's balance. Default 1.
    "VLLM_DP_PINNED_WEIGHT": lambda: float(os.getenv("VLLM_DP_PINNED_WEIGHT") or 1),
    # How much the CPU engine process lowers its priority (nice increment) so the API
    # front end stays responsive; 0 disables. Default 10.
    "VLLM_CPU_ENGINE_NICE": lambda: int(os.getenv("VLLM_CPU_ENGINE_NICE") or 10),
    # Seconds an engine process whose front end is gone may take to stop (it finishes
    # the step it is in) before it ends itself. Default 10.
    "VLLM_ENGINE_ORPHAN_GRACE_S": lambda: float(os.getenv("VLLM_ENGINE_ORPHAN_GRACE_S") or 10),
    # Compute dtype of --quantization gguf's prefill GEMMs (forwards of at least
    # DENSE_MIN_TOKENS rows; attention stays fp32): auto = bf16 when the CPU has
    # native bf16 arithmetic (AVX512-BF16 or AMX-BF16), else fp32; bf16; fp32 (the exact
    # path: on AVX-512 CPUs bit-identical to the fp32 model's prefill GEMMs; on AVX2 CPUs
    # the block kernel at every size, faster there, only the summation order differs).
    # Read when a model is loaded.
    "VLLM_CPU_GGUF_PREFILL_DTYPE": _choice("VLLM_CPU_GGUF_PREFILL_DTYPE", ("auto", "bf16", "fp32")),
    # Activations of --quantization gguf's decode forwards (5 to DENSE_MIN_TOKENS - 1 rows):
    # auto = bf16 when the prefill runs in bf16 (VLLM_CPU_GGUF_PREFILL_DTYPE) and the CPU has
    # AMX-BF16, else fp32; fp32 (the exact path: only the summation order differs from the
    # fp32 model); int8 (each 32-value block of a row rounded to int8 with an fp32 scale,
    # integer dot products on AVX512-VNNI; fp32 on CPUs without it); bf16 (rows and weights
    # rounded to bf16, products summed in fp32 on AMX tiles; fp32 on CPUs without AMX-BF16).
    # Read when a model is loaded.
    "VLLM_CPU_GGUF_DECODE_ACT": _choice(
        "VLLM_CPU_GGUF_DECODE_ACT", ("auto", "fp32", "int8", "bf16")
    ),
    # Seconds between the server's throughput log lines (vllm/v1/metrics/loggers.py;
    # --disable-log-stats: none). Default 10, as vLLM.
    "VLLM_LOG_STATS_INTERVAL": lambda: float(os.getenv("VLLM_LOG_STATS_INTERVAL") or 10.0),
    # "1"/"true": the server takes /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    # switch: anyone who reaches the server can then make it read a folder). Default off.
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": lambda: (
        os.getenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
    ),
    # "1"/"true": vLLM's development routes (here POST /reset_prefix_cache). Default off.
    "VLLM_SERVER_DEV_MODE": lambda: (
        os.getenv("VLLM_SERVER_DEV_MODE", "").strip().lower() in ("1", "true")
    ),
    # vLLM's variable: "1" logs each garbage collection of the engine and API processes
    # (generation, duration, objects freed); '{"top_objects": N}' adds the N commonest types
    # examined. Unset: no log (vllm/utils/gc_utils.py).
    "VLLM_GC_DEBUG": lambda: (os.getenv("VLLM_GC_DEBUG") or "").strip() or None,
    # vLLM's variable: the level of vllm serve's logs (--log-level wins). Default INFO.
    "VLLM_LOGGING_LEVEL": lambda: (os.getenv("VLLM_LOGGING_LEVEL") or "INFO").strip(),
    # vLLM's variable: KV cache events name blocks by a 64-bit integer (the low 64 bits
    # of the hash); "0": by the whole 32-byte sha256 digest.
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": lambda: (
        os.getenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"
    ),
    # vLLM's variable: seconds the server may take to fetch an image an http(s) URL of a
    # chat request names (vllm/multimodal/media.py); a slower fetch is a 400. Default 5.
    "VLLM_IMAGE_FETCH_TIMEOUT": _positive_seconds("VLLM_IMAGE_FETCH_TIMEOUT", 5.0),
    # "0": serve on asyncio's event loop instead of uvloop. Default: uvloop if installed.
    "VLLM_USE_UVLOOP": lambda: os.getenv("VLLM_USE_UVLOOP", "1") != "0",
    # libgomp's spin count / wait policy: when the user sets either, the engine process
    # keeps them; unset, it gets a short spin (vllm/v1/engine/core_client.py).
    "GOMP_SPINCOUNT": lambda: os.getenv("GOMP_SPINCOUNT"),
    "OMP_WAIT_POLICY": lambda: os.getenv("OMP_WAIT_POLICY"),
    # Folder of the per-job scheduler event log (scheduler_timestamps.json); unset: none.
    "RUN_OUTPUT_DIR": lambda: os.getenv("RUN_OUTPUT_DIR") or None,
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
