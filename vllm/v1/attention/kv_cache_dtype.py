"""The KV cache's storage type (``--kv-cache-dtype``): the model's dtype (``auto``) or FP8.

An FP8 cache (``fp8`` = ``fp8_e4m3``: float8_e4m3fn, max 448, 3 mantissa bits;
``fp8_e5m2``: max 57,344, 2 mantissa bits) holds each K and V element in one byte: half a
bf16 cache, so twice the tokens fit in the same memory, and a decode step reads half the
context bytes. Values are stored divided by the checkpoint's calibrated scales where it has
them (``quantization/kv_scales.py``, applied around the backends), else, as vLLM does
without scales, with a scale of 1.0: cast to the FP8 type after saturating at its largest
finite value (a plain cast to e5m2 turns the rare larger value into an infinity), and read
back exactly (every FP8 value is a bf16, fp16 and fp32 value). Attention always sees the
stored values: a prompt's own attention reads its K/V through the same rounding as every
later step.
"""

from __future__ import annotations

import torch

# --kv-cache-dtype choices (vLLM's names) -> the storage dtype; "auto": the model's.
FP8_KV_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The model's dtype named (vLLM's way to keep an FP8-KV checkpoint's cache unquantized).
MODEL_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_CACHE_DTYPES = ("auto", *MODEL_KV_DTYPES, *FP8_KV_DTYPES)


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of ``--kv-cache-dtype cache_dtype`` for a model in ``model_dtype``.
    A dtype named must be the model's: a cache in another unquantized dtype is not built."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype in MODEL_KV_DTYPES:
        if MODEL_KV_DTYPES[cache_dtype] != model_dtype:
            raise ValueError(
                f"kv_cache_dtype={cache_dtype!r}: the model runs in {model_dtype}; a cache in "
                "another unquantized dtype is not implemented (auto, the model's dtype or fp8)"
            )
        return model_dtype
    if cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype={cache_dtype!r}: expected one of {KV_CACHE_DTYPES}")
    return FP8_KV_DTYPES[cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it: unchanged for a cache in its dtype; saturated at the
    FP8 type's largest finite value and cast for an FP8 cache."""
    if not is_fp8(dtype) or x.dtype == dtype:
        return x if x.dtype == dtype else x.to(dtype)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` (a step's own K or V, in the model's dtype) rounded as an FP8 cache stores it,
    back in ``x``'s dtype; ``x`` itself for a cache in the model's dtype."""
    if not is_fp8(cache_dtype):
        return x
    return to_cache(x, cache_dtype).to(x.dtype)


def fp8_kind(dtype: torch.dtype) -> int:
    """The Triton kernels' ``KV_FP8`` constexpr: 0 (not FP8), 1 (e4m3fn), 2 (e5m2)."""
    return {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}.get(dtype, 0)
