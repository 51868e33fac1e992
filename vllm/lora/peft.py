"""Reading a PEFT LoRA checkpoint: ``adapter_config.json`` and ``adapter_model.safetensors``
(or ``adapter_model.bin``), as PEFT saves them.

Each targeted module ``m`` of layer ``i`` holds ``lora_A`` ``(r, in)`` and ``lora_B``
``(out, r)``; PEFT's forward adds ``scaling * x @ A.T @ B.T`` to the module's output,
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), per module
where ``rank_pattern`` / ``alpha_pattern`` say so. The scaling is folded into B here.

Supported targets: the attention's q/k/v/o projections and the dense MLP's gate/up/down
projections (fused ``qkv_proj`` and ``gate_up_proj`` too, where the model's checkpoint
fuses them, as Phi-3's does). Anything else an adapter changes (embeddings, the output head, biases,
DoRA magnitudes, MoE experts, ``modules_to_save``) is refused with a ``ValueError`` that
names it: an adapter served without part of itself would answer wrongly.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)  # the last two: checkpoints that fuse them (Phi-3)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:model\.)?layers\.(?P<layer>\d+)\."
    r"(?:self_attn|mlp)\.(?P<target>\w+))\.lora_(?P<ab>[AB])(?:\.default)?\.weight$"
)


@dataclass
class LoRAAdapter:
    """An adapter's weights in fp32 on the CPU: ``weights[(layer, target)] = (A, B)``,
    A ``(r, in)``, B ``(out, r)`` with the scaling folded in."""

    name: str
    rank: int  # the largest module rank
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: str, max_rank: int) -> dict:
    """``path``'s adapter_config.json, checked: a LoRA adapter of rank <= ``max_rank``
    using only what this engine applies. ``ValueError`` naming the problem otherwise."""
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"LoRA adapter path {path!r} has no adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {config['peft_type']!r}, not 'LORA'")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        problems.append("adapter biases are not supported")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']} is not supported")
    ranks = [config.get("r", 0), *(config.get("rank_pattern") or {}).values()]
    if any(not isinstance(r, int) or r < 1 for r in ranks):
        problems.append(f"ranks {ranks} must be integers >= 1")
    elif max(ranks) > max_rank:
        problems.append(f"rank {max(ranks)} is greater than max_lora_rank {max_rank}")
    if problems:
        raise ValueError(f"LoRA adapter {path!r}: " + "; ".join(problems))
    return config


def _pattern_value(pattern: dict | None, module: str):
    """PEFT's rule: the first key that matches a dotted suffix of the module's name."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def scaling(config: dict, module: str, rank: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern"), module)
    alpha = config.get("lora_alpha", 8) if alpha is None else alpha
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    safetensors = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(safetensors):
        from safetensors.torch import load_file

        return load_file(safetensors)
    pickled = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pickled):
        return torch.load(pickled, map_location="cpu", weights_only=True)
    raise ValueError(
        f"LoRA adapter path {path!r} has no adapter_model.safetensors or adapter_model.bin"
    )


def load_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """The adapter in ``path`` (``read_adapter_config``'s checks, then every tensor
    parsed); ``ValueError`` for a tensor it cannot apply or a lora_A without its lora_B."""
    config = read_adapter_config(path, max_rank)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}
    for key, tensor in _read_tensors(path).items():
        m = _KEY.match(key)
        if m is None or m["target"] not in TARGETS:
            raise ValueError(
                f"LoRA adapter {path!r} changes {key!r}, which this engine does not apply "
                f"(it applies LoRA to {', '.join(TARGETS)} of dense layers)"
            )
        at = (int(m["layer"]), m["target"])
        halves.setdefault(at, {})[m["ab"]] = tensor
        modules[at] = m["module"]
    weights = {}
    for at, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {modules[at]} lacks lora_A or lora_B")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(
                f"LoRA adapter {path!r}: {modules[at]} has lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}, not (r, in) and (out, r)"
            )
        if a.shape[0] > max_rank:
            raise ValueError(
                f"LoRA adapter {path!r}: {modules[at]} has rank {a.shape[0]}, greater than "
                f"max_lora_rank {max_rank}"
            )
        weights[at] = (a, b * scaling(config, modules[at], a.shape[0]))
    if not weights:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    return LoRAAdapter(name, max(a.shape[0] for a, _ in weights.values()), weights)
