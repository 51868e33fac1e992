"""FP8 KV caches with the checkpoint's scales: an FP8-KV checkpoint's ``kv_cache_scheme``
read, its ``k_scale`` / ``v_scale`` tensors taken out of the state dict, and each layer's
attention wrapped to use them.

A checkpoint calibrated for an FP8 KV cache (llm-compressor's ``kv_cache_scheme``, ModelOpt's
per-layer scales) stores, per attention layer, a scale for the keys and one for the values,
one per tensor or one per KV head (``strategy: "attn_head"``): the cache holds ``k /
k_scale`` and ``v / v_scale`` in FP8, so that keys larger than the format's range (448 for
e4m3) survive and small ones keep their mantissa. As in vLLM:

- a checkpoint with a ``kv_cache_scheme`` gets an FP8 cache when ``--kv-cache-dtype`` is
  ``auto`` (``resolve_cache_dtype``); an explicit ``--kv-cache-dtype`` wins;
- the scales apply only to an FP8 cache: a cache in the model's dtype ignores them (they
  describe the FP8 rounding, nothing else);
- a layer with no scale uses 1.0; a single ``kv_scale`` serves both K and V.

The scales never reach the attention backends. Attention over the stored values is linear
in V and sees K only through ``q . k``, so for each KV head ``h``:
``attention(q, K, V) = v_scale[h] * attention(q * k_scale[h], K / k_scale[h], V / v_scale[h])``
with the stored ``K / k_scale`` and ``V / v_scale``. ``scaled_attention`` wraps a layer's
attention call with exactly that (per tensor, ``k_scale`` folds into the softmax scale:
soft caps apply to the scaled scores, so they see the same values), and every backend, its
kernels and its CUDA graphs take FP8 scales unchanged.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.quantization.checkpoint_config import bad_field, check_keys

logger = logging.getLogger(__name__)

SCHEME_FIELDS = {"num_bits", "type", "strategy", "symmetric", "dynamic", "group_size",
                 "block_structure", "actorder", "observer", "observer_kwargs"}  # fmt: skip
STRATEGIES = ("tensor", "attn_head")

# A scale tensor's name -> its layer and whether it scales K, V or both, in the layouts vLLM
# reads: ``...layers.N.self_attn.k_scale`` (llm-compressor), ``...k_proj.k_scale`` (ModelOpt),
# ``...qkv_proj.k_scale``, and the older single ``...self_attn.kv_scale``.
_SCALE_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:[a-z_]+\.)?(?:(?:[kv]|qkv)_proj\.)?(k|v|kv|q|prob)_scale$"
)


@dataclass(frozen=True)
class KVCacheScheme:
    """A checkpoint's FP8 KV-cache scheme: one scale per tensor or per KV head."""

    strategy: str


def kv_cache_scheme_of(quant: Any) -> KVCacheScheme | None:
    """The ``kv_cache_scheme`` of an HF ``quantization_config`` (dict or transformers'
    object); None when it has none. ``ValueError`` naming the field for a scheme other
    than vLLM's: 8-bit float, symmetric, static, per tensor or per KV head."""
    if not quant:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    s = quant.get("kv_cache_scheme")
    if not s:
        return None
    where = "kv_cache_scheme."
    check_keys(s, SCHEME_FIELDS, where)
    for key, ok in (("num_bits", 8), ("type", "float"), ("symmetric", True),
                    ("dynamic", False), ("group_size", None), ("block_structure", None),
                    ("actorder", None)):  # fmt: skip
        if s.get(key, ok) != ok:
            raise bad_field(where + key, s[key], f"only {ok!r}")
    strategy = s.get("strategy", "tensor")
    if strategy not in STRATEGIES:
        raise bad_field(where + "strategy", strategy, " or ".join(STRATEGIES))
    return KVCacheScheme(strategy)


def resolve_cache_dtype(cache_dtype: str, hf_config: Any) -> str:
    """``--kv-cache-dtype`` for this model: ``auto`` becomes ``fp8`` when the checkpoint
    declares an FP8 KV-cache scheme (vLLM's rule); anything explicit stays."""
    quant = getattr(hf_config, "quantization_config", None)
    if cache_dtype == "auto" and kv_cache_scheme_of(quant) is not None:
        logger.info("The checkpoint's kv_cache_scheme asks for an FP8 KV cache: kv_cache_dtype=fp8")
        return "fp8"
    return cache_dtype


def pop_kv_scales(state: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    """Take every KV-cache scale out of ``state`` (the model classes load weights only):
    ``{layer: {"k": scale, "v": scale}}``, each a float32 tensor of one value or one per
    KV head. A ``kv_scale`` gives both; query and softmax scales (FP8 attention, which
    this engine does not run) are dropped with a log line."""
    scales: dict[int, dict[str, torch.Tensor]] = {}
    dropped = []
    for name in [n for n in state if n.endswith("_scale")]:
        m = _SCALE_NAME.search(name)
        if m is None:
            continue
        tensor = state.pop(name).float().reshape(-1)
        layer, which = int(m.group(1)), m.group(2)
        if which in ("q", "prob"):
            dropped.append(name)
            continue
        for part in ("k", "v") if which == "kv" else (which,):
            scales.setdefault(layer, {})[part] = tensor
    if dropped:
        logger.info(
            "%d query/softmax scales (e.g. %s) not used: attention runs in the model's dtype",
            len(dropped),
            dropped[0],
        )
    return scales


def per_head(scale: torch.Tensor | None, num_kv_heads: int, name: str) -> torch.Tensor:
    """``scale`` (one value or one per KV head; None: 1.0) as ``(num_kv_heads,)``;
    ``ValueError`` naming the tensor for anything else or a value that is not > 0."""
    if scale is None:
        return torch.ones(num_kv_heads)
    if scale.numel() not in (1, num_kv_heads):
        raise ValueError(
            f"{name}: {scale.numel()} values, expected 1 or one per KV head ({num_kv_heads})"
        )
    if not bool((scale > 0).all()) or not bool(scale.isfinite().all()):
        raise ValueError(f"{name}: KV-cache scales must be finite and > 0, got {scale.tolist()}")
    return scale.expand(num_kv_heads).contiguous()


def scaled_attention(
    attn_forward: Callable[..., torch.Tensor],
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    num_heads: int,
) -> Callable[..., torch.Tensor]:
    """``attn_forward(q, k, v, kv_cache, meta, scale)`` over a cache holding ``k / k_scale``
    and ``v / v_scale`` (per KV head, ``(num_kv_heads,)`` on the layer's device in its
    dtype, which the scales are rounded to, on both sides), returning
    what attention over the unscaled K and V gives (the module docstring)."""
    group = num_heads // k_scale.numel()
    uniform_k = bool((k_scale == k_scale[0]).all())
    uniform_v = bool((v_scale == v_scale[0]).all())
    # The values K and V are divided by, in their dtype, are the ones multiplied back.
    ks, vs = float(k_scale[0]), float(v_scale[0])
    k_div, v_div = k_scale.view(-1, 1), v_scale.view(-1, 1)
    # (heads, 1) multipliers: query head i reads KV head i // group.
    q_mul = k_scale.repeat_interleave(group).view(-1, 1)
    out_mul = v_scale.repeat_interleave(group).view(-1, 1)

    def forward(q, k, v, kv_cache, meta, scale, **kwargs):
        if k is None or v is None:
            raise RuntimeError("KV-cache scales need the step's K and V (no fused cache write)")
        k, v = k / k_div, v / v_div
        if uniform_k:
            scale = scale * ks
        else:
            q = q * q_mul
        out = attn_forward(q, k, v, kv_cache, meta, scale, **kwargs)
        if uniform_v:
            return out if vs == 1.0 else out * vs
        return out * out_mul

    forward.kv_scales = (k_scale, v_scale)  # what the tests and the log read
    return forward


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """The module of each decoder layer whose ``attn_forward`` attends: ``{layer: module}``
    (``layers.N`` itself, or its ``self_attn``)."""
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        m = re.search(r"(?:^|\.)layers\.(\d+)(?:\.self_attn)?$", name)
        if m is not None and hasattr(module, "attn_forward"):
            found.setdefault(int(m.group(1)), module)
    return found


def apply_kv_scales(model: nn.Module, cache_is_fp8: bool, model_dtype: torch.dtype) -> int:
    """Wrap each layer's ``attn_forward`` (just installed by ``set_attention_backend``)
    with the checkpoint's KV scales (``model.kv_scales``, from ``pop_kv_scales``) in
    ``model_dtype`` (the attention's inputs) when the cache is FP8. Returns the layers
    wrapped. A cache in the model's dtype ignores them, as vLLM's does; ``ValueError`` for
    scales a layer cannot take."""
    scales = getattr(model, "kv_scales", None) or {}
    if not scales:
        return 0
    if not cache_is_fp8:
        logger.info("The checkpoint's KV-cache scales are not used: the cache is not FP8")
        return 0
    arch = model.arch
    if getattr(arch, "kv_lora_rank", None):
        raise ValueError(
            "KV-cache scales for multi-head latent attention (MLA) are not implemented; "
            "serve this checkpoint with --kv-cache-dtype auto"
        )
    modules = attention_modules(model)
    device, dtype = next(model.parameters()).device, model_dtype
    missing = sorted(set(scales) - set(modules))
    if missing:
        raise ValueError(f"KV-cache scales for layer {missing[0]}, which the model does not have")
    for layer, module in modules.items():
        s = scales.get(layer, {})
        k = per_head(s.get("k"), arch.num_kv_heads, f"layers.{layer}.k_scale")
        v = per_head(s.get("v"), arch.num_kv_heads, f"layers.{layer}.v_scale")
        module.attn_forward = scaled_attention(
            module.attn_forward, k.to(device, dtype), v.to(device, dtype), arch.num_heads
        )
    logger.info("FP8 KV cache with the checkpoint's scales on %d layers", len(scales))
    return len(modules)
