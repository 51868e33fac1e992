"""Rotary position embedding: the frequencies of each rotated pair of dimensions, with the
context-extension schemes an HF config names in ``rope_parameters`` (transformers 5) or
``rope_scaling`` (older configs).

Supported ``rope_type`` values, with the semantics transformers and vLLM give them:

- ``default``: ``theta ** (-2i / head_dim)`` for pair ``i``.
- ``linear`` (position interpolation): every frequency divided by ``factor``; the model's
  usable length is ``max_position_embeddings * factor``.
- ``llama3`` (Llama 3.1 and 3.2): pairs whose wavelength is longer than
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those
  shorter than ``original_max_position_embeddings / high_freq_factor`` are kept, and the
  band between blends the two linearly in ``original / wavelength``.
- ``yarn``: a ramp over the pairs between the dimensions that turn ``beta_fast`` and
  ``beta_slow`` times over ``original_max_position_embeddings`` blends the divided
  (interpolated) frequencies with the kept (extrapolated) ones, and cos and sin are scaled
  by an attention factor (``attention_factor``, or ``0.1 ln(factor) + 1``, or the
  ``mscale``/``mscale_all_dim`` ratio).

- ``longrope`` (Phi-3/3.5/4-mini's long-context variants): each pair's frequency divided
  by its own factor, from ``long_factor`` when the engine's ``max_model_len`` exceeds
  ``original_max_position_embeddings`` and from ``short_factor`` otherwise (vLLM's static
  choice; transformers switches per sequence length), cos and sin scaled by
  ``attention_factor`` or ``sqrt(1 + ln(s) / ln(original))``, ``s`` the extension ratio.

- ``proportional`` (Gemma 4's global layers): pair ``i`` turns at ``theta ** (-2i /
  head_dim)`` for the first ``partial_rotary_factor * head_dim / 2`` pairs and not at all
  (frequency 0) for the rest, every frequency divided by ``factor`` (default 1); the pairs
  span the whole head (dimension ``i`` with ``i + head_dim / 2``), unlike a partial rotary
  embedding's.

For the other types, ``partial_rotary_factor`` below 1 rotates only the first ``head_dim *
factor`` dimensions of each head (Phi-4-mini; ``rotary_dim``), the frequencies computed
over those.

For ``llama3``, ``yarn`` and ``longrope`` ``max_position_embeddings`` already counts the
extension (as vLLM reads those configs). ``dynamic`` (NTK scaling recomputed per sequence
length) is not supported and raises ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


# The layer types a config's ``rope_parameters`` may be keyed by (Gemma 3: one rotation
# for its sliding-window layers, another for its global ones).
LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_parameters(hf_config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    """The config's rotary parameters as one dict with ``rope_type`` and ``rope_theta``
    (from ``rope_parameters``, else ``rope_scaling`` plus ``rope_theta``), those of the
    layers of ``layer_type`` where the config gives one set per layer type; ``ValueError``
    for a type this engine does not compute."""
    raw = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if raw and set(raw) & set(LAYER_TYPES):
        raw = raw.get(layer_type) or raw.get("full_attention")
    params = dict(raw or {})
    rope_type = params.pop("type", None)  # the old name of the key
    params["rope_type"] = params.get("rope_type") or rope_type or "default"
    if not params.get("rope_theta"):
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    params["rope_theta"] = float(params["rope_theta"])
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {params['rope_type']!r} is not supported yet (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1))
    partial = 1.0 if partial is None else float(partial)
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"partial_rotary_factor {partial} must be in (0, 1]")
    params["partial_rotary_factor"] = partial
    if params["rope_type"] == "longrope":
        _longrope_parameters(params, hf_config)
    elif params["rope_type"] not in ("default", "proportional"):
        _require(params, "factor")
    if params["rope_type"] in ("llama3", "yarn"):
        _require(params, "original_max_position_embeddings")
    if params["rope_type"] == "llama3":
        _require(params, "low_freq_factor", "high_freq_factor")
        if params["high_freq_factor"] <= params["low_freq_factor"]:
            raise ValueError("llama3 rope: high_freq_factor must exceed low_freq_factor")
    return params


def _longrope_parameters(params: dict[str, Any], hf_config: Any) -> None:
    """Complete a longrope dict in place: the original and extended lengths (from the
    config where the dict lacks them) and ``long_rope``, whether the long factors apply
    (``use_long_rope`` sets it from the engine's ``max_model_len``; by default the model's
    whole length decides)."""
    params.setdefault(
        "original_max_position_embeddings",
        getattr(hf_config, "original_max_position_embeddings", None),
    )
    params.setdefault(
        "max_position_embeddings", getattr(hf_config, "max_position_embeddings", None)
    )
    _require(params, "short_factor", "long_factor", "original_max_position_embeddings")
    if len(params["short_factor"]) != len(params["long_factor"]):
        raise ValueError("longrope rope parameters: short_factor and long_factor differ in length")
    if "long_rope" not in params:
        extended = params["max_position_embeddings"] or params["original_max_position_embeddings"]
        params["long_rope"] = extended > params["original_max_position_embeddings"]


def use_long_rope(hf_config: Any, max_model_len: int) -> None:
    """Tell a longrope config which factors the engine serves with: the long ones when
    ``max_model_len`` exceeds the original context (as vLLM decides, once, at start-up),
    the short ones otherwise. A no-op for every other rope type."""
    for attr in ("rope_parameters", "rope_scaling"):
        raw = getattr(hf_config, attr, None)
        if not isinstance(raw, dict):
            continue
        if (raw.get("rope_type") or raw.get("type")) == "longrope":
            original = raw.get("original_max_position_embeddings") or getattr(
                hf_config, "original_max_position_embeddings", None
            )
            if original is not None:
                raw["long_rope"] = max_model_len > original
            return


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dimensions of each head rotate (``partial_rotary_factor``; all of
    them for ``proportional``, whose unturned pairs have frequency 0)."""
    if params.get("rope_type") == "proportional":
        return head_dim
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _require(params: dict[str, Any], *keys: str) -> None:
    missing = [k for k in keys if params.get(k) is None]
    if missing:
        raise ValueError(f"{params['rope_type']} rope parameters lack {', '.join(missing)}")


def max_positions(max_position_embeddings: int, params: dict[str, Any]) -> int:
    """The longest context the rotary table must cover: ``linear`` stretches the trained
    length by its factor; the other types' configs already give the extended length."""
    if params["rope_type"] == "linear":
        return int(max_position_embeddings * params["factor"])
    return max_position_embeddings


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(fp32 ``(head_dim // 2,)`` inverse frequencies, the factor cos and sin are scaled by)
    for ``params`` (``rope_parameters``' dict); ``head_dim``: the dimensions that rotate
    (``rotary_dim``)."""
    base = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / params["rope_theta"] ** base
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "longrope":
        return _longrope(inv_freq, params)
    if rope_type == "proportional":
        return _proportional(head_dim, params), 1.0
    factor = float(params["factor"])
    if rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, factor, params), 1.0
    return _yarn(inv_freq, head_dim, factor, params)


def _proportional(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """``proportional``'s ``(head_dim // 2,)`` frequencies (the module docstring)."""
    turned = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = torch.arange(0, 2 * turned, 2, dtype=torch.float32) / head_dim
    inv_freq = torch.zeros(head_dim // 2, dtype=torch.float32)
    inv_freq[:turned] = 1.0 / params["rope_theta"] ** exponents
    return inv_freq / float(params.get("factor") or 1.0)


def _longrope(inv_freq: torch.Tensor, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factors = params["long_factor"] if params["long_rope"] else params["short_factor"]
    if len(factors) != inv_freq.numel():
        raise ValueError(
            f"longrope rope parameters: {len(factors)} factors for {inv_freq.numel()} rotated pairs"
        )
    inv = inv_freq / torch.tensor(factors, dtype=torch.float32)
    if params.get("attention_factor") is not None:
        return inv, float(params["attention_factor"])
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or (params["max_position_embeddings"] or original) / original
    if factor <= 1.0:
        return inv, 1.0
    return inv, math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3(inv_freq: torch.Tensor, factor: float, params: dict[str, Any]) -> torch.Tensor:
    original = params["original_max_position_embeddings"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    # 0 where the wavelength is original / low (and longer: divided), 1 where it is
    # original / high (and shorter: kept).
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return inv_freq / factor * (1 - blend) + inv_freq * blend


def _yarn(
    inv_freq: torch.Tensor, head_dim: int, factor: float, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    theta = params["rope_theta"]
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        # The dimension whose pair turns `rotations` times over the original length.
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: high-frequency pairs, kept; ramp 1: low-frequency pairs, divided by factor.
    inv = inv_freq * (1 - ramp) + inv_freq / factor * ramp
    return inv, _yarn_attention_factor(factor, params)


def _yarn_attention_factor(factor: float, params: dict[str, Any]) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def scale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return scale(mscale) / scale(mscale_all_dim)
    return scale(1.0)


def cos_sin_cache(head_dim: int, num_positions: int, params: dict[str, Any]) -> torch.Tensor:
    """fp32 ``(num_positions, rotary_dim)`` table of ``[cos | sin]`` rows by position
    (vLLM's layout), each scaled by the type's attention factor; ``rotary_dim`` is
    ``head_dim`` unless the rotation is partial."""
    inv_freq, attention_factor = inverse_frequencies(rotary_dim(head_dim, params), params)
    angles = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor
