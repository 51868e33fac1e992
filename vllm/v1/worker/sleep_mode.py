"""Sleep mode's weight moves: a model's tensors to host memory and back (level 1).

vLLM swaps the weights' device memory out through its CUDA allocator; we move the tensors
themselves. Every module's parameters, buffers and plain tensor attributes (quantized
layers keep packed weights as attributes) are moved in place (``tensor.data``, or the
attribute rebound), so the modules that hold them keep working after the move back.
"""

from __future__ import annotations

import torch
from torch import nn

SLEEP_TAGS = ("weights", "kv_cache")  # what levels 1 and 2 take off the device
WAKE_UP_TAGS = (*SLEEP_TAGS, "scheduling")  # vLLM's wake_up tags; none given = all


def check_wake_up_tags(tags: list[str] | None) -> tuple[str, ...]:
    """The memory tags to wake (both for None or []; "scheduling" names none: scheduling
    resumes once both are back); ``ValueError`` naming an unknown tag."""
    if not tags:
        return SLEEP_TAGS
    unknown = [t for t in tags if t not in WAKE_UP_TAGS]
    if unknown:
        raise ValueError(f"wake_up tags must be among {list(WAKE_UP_TAGS)}, got {unknown}")
    return tuple(t for t in dict.fromkeys(tags) if t in SLEEP_TAGS)


def check_sleep_level(level: int) -> None:
    """vLLM's levels: 0 pauses scheduling, 1 frees the KV cache and offloads the weights,
    2 frees both."""
    if isinstance(level, bool) or level not in (0, 1, 2):
        raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")


def move_module_tensors(model: nn.Module, device: torch.device) -> int:
    """Move every tensor ``model`` holds to ``device`` in place (``swap_tensors``: each
    Parameter, buffer and tensor attribute stays the same Python object, so tied weights
    and whatever else refers to them follow); returns the bytes moved. Host copies are
    page-locked when leaving a CUDA device (the way back is faster)."""
    pin = device.type == "cpu" and torch.cuda.is_available()
    moved = 0
    seen: set[int] = set()
    for module in model.modules():
        attrs = [v for k, v in vars(module).items() if k not in ("_parameters", "_buffers")]
        for tensor in (*module._parameters.values(), *module._buffers.values(), *attrs):
            if not isinstance(tensor, torch.Tensor) or tensor.device == device:
                continue
            if id(tensor) in seen:  # tied weights move once
                continue
            seen.add(id(tensor))
            moved += tensor.numel() * tensor.element_size()
            new = tensor.detach().to(device)
            if pin:
                new = new.pin_memory()
            if isinstance(tensor, nn.Parameter):
                new = nn.Parameter(new, requires_grad=tensor.requires_grad)
            torch.utils.swap_tensors(tensor, new)
    return moved
