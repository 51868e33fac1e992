"""Picks the attention backend class for a model runner among the registered ones
(``backends/registry.py``): the highest ``priority`` whose ``validate_configuration``
finds nothing wrong. With the three built in: torch's own FlashAttention
(``TORCH_FLASH_ATTN``) on CUDA in fp16/bf16, the flash-attn package (``FLASH_ATTN``) where
torch's cannot run and the package is installed, torch SDPA otherwise (CPU, and fp32 on
CUDA: the exactness reference).

``--attention-backend`` (or ``VLLM_ATTENTION_BACKEND``, vLLM's variable; the flag wins)
forces a registered name instead: a backend
that cannot run here raises rather than silently falling back, so a forced benchmark
never measures the wrong kernel (``TORCH_SDPA`` can always run).

A backend written for one kind of model (``required_features``: ``TRITON_MLA`` serves MLA's
latent cache only) is not a candidate for the others, so it raises no warning there.
"""

from __future__ import annotations

import logging

import torch

from vllm import envs
from vllm.v1.attention.backends.abstract import AttentionBackend
from vllm.v1.attention.backends.registry import backend_names, get_backend_class

logger = logging.getLogger(__name__)

ENV_VAR = "VLLM_ATTENTION_BACKEND"


def select_attention_backend(
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    head_size: int,
    forced: str | None = None,
    features: frozenset[str] = frozenset(),
) -> type[AttentionBackend]:
    """The backend class for this device/dtype/block size/head size and the attention
    ``features`` the model's layers use (``AttentionBackend.supported_features``); see the
    module docstring. ``forced``: --attention-backend (else ``VLLM_ATTENTION_BACKEND``).
    ValueError when the forced backend is unknown or cannot run here."""

    features = frozenset(features)

    def why_not(cls: type[AttentionBackend]) -> list[str]:
        reasons = cls.validate_configuration(device, dtype, block_size, head_size)
        missing = sorted(cls.required_features - features)
        if missing:
            names = ", ".join(f.replace("_", " ") for f in missing)
            reasons.append(f"{cls.name} serves only models whose attention uses {names}")
        return reasons + cls.unsupported_features(features)

    source = "--attention-backend" if forced is not None else ENV_VAR
    forced = forced if forced is not None else envs.VLLM_ATTENTION_BACKEND
    if forced is not None:
        if forced not in backend_names():
            raise ValueError(f"{source}={forced!r}: expected one of {', '.join(backend_names())}")
        cls = get_backend_class(forced)
        reasons = why_not(cls)
        if reasons:
            raise ValueError(f"{source}={forced} but {'; '.join(reasons)}")
        return cls
    classes = sorted(map(get_backend_class, backend_names()), key=lambda c: -c.priority)
    classes = [c for c in classes if c.required_features <= features]
    skipped = []
    for cls in classes:
        reasons = why_not(cls)
        if not reasons:
            # A backend meant for this device that could not run deserves a warning
            # (FlashAttention on CUDA in fp32, say); one for another device does not.
            for other, why in skipped:
                if device.type in other.device_types:
                    logger.warning("Not using %s: %s; using %s", other.name, why, cls.name)
            return cls
        skipped.append((cls, "; ".join(reasons)))
    raise ValueError(
        "no attention backend can run here: " + "; ".join(f"{c.name}: {why}" for c, why in skipped)
    )
