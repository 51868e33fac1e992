"""The model runner's adapters: wraps the model's linear layers in ``LoRALinear`` once, then
gives each adapter a device slot when a request needs it.

Slots: ``max_loras`` of them. An adapter keeps its slot while any request of the runner
uses it; a new adapter takes a free slot, else the least recently used slot no running
request uses. The scheduler admits at most ``max_loras`` distinct adapters among running
requests, so a slot is always found. Read adapters stay in host memory (up to
``max_cpu_loras``, least recently used dropped first), so a slot reloads without files.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from vllm.config import LoRAConfig
from vllm.lora.layers import LoRABatch, LoRALinear
from vllm.lora.peft import LoRAAdapter, load_adapter
from vllm.lora.request import LoRARequest


class LoRAAdapterError(ValueError):
    """An adapter a request names cannot be loaded or applied: that request fails (400)."""


# Our fused layers and the checkpoint projections (PEFT targets) they are made of.
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, device, dtype) -> None:
        a = model.arch
        self.config = config
        self.batch = LoRABatch(config.max_loras)
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        dims = {  # layer attribute: (in_features, slice widths)
            "qkv_proj": (a.hidden_size, [q, kv, kv]),
            "o_proj": (q, [a.hidden_size]),
            "gate_up_proj": (a.hidden_size, [a.intermediate_size] * 2),
            "down_proj": (a.intermediate_size, [a.hidden_size]),
        }
        # (layer index, fused attribute) -> the wrapped layer
        self.layers: dict[tuple[int, str], LoRALinear] = {}
        for i, layer in enumerate(model.layers):
            for attr, (in_features, slices) in dims.items():
                base = getattr(layer, attr, None)
                if base is None:  # a mixture-of-experts layer has no dense MLP
                    continue
                wrapped = LoRALinear(
                    base, in_features, slices, config.max_loras, config.max_lora_rank,
                    self.batch, dtype, torch.device(device),
                )  # fmt: skip
                setattr(layer, attr, wrapped)
                self.layers[(i, attr)] = wrapped
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self._read: OrderedDict[int, LoRAAdapter] = OrderedDict()  # host copies, LRU first

    def activate(self, request: LoRARequest, in_use: set[int]) -> int:
        """The slot holding ``request``'s adapter, loading it if needed (into a free slot,
        else the least recently used one whose adapter is not in ``in_use``).
        ``LoRAAdapterError`` for an adapter that cannot be read or applied."""
        lid = request.lora_int_id
        if lid in self._slots:
            self._slots.move_to_end(lid)
            return self._slots[lid]
        try:
            adapter = self._adapter(request)
        except ValueError as e:
            raise LoRAAdapterError(str(e)) from e
        taken = set(self._slots.values())
        free = [s for s in range(1, self.config.max_loras + 1) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((v for v in self._slots if v not in in_use), None)
            if victim is None:
                raise RuntimeError(
                    f"no LoRA slot free for adapter {request.lora_name!r}: all "
                    f"{self.config.max_loras} hold adapters of running requests"
                )
            slot = self._slots.pop(victim)
        self._fill(slot, adapter)
        self._slots[lid] = slot
        return slot

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        lid = request.lora_int_id
        if lid in self._read:
            self._read.move_to_end(lid)
            return self._read[lid]
        adapter = load_adapter(request.lora_name, request.lora_path, self.config.max_lora_rank)
        self._split_fused(adapter, request)
        self._check_fits(adapter, request)
        self._read[lid] = adapter
        while len(self._read) > self.config.num_cpu_loras:
            self._read.popitem(last=False)
        return adapter

    def _split_fused(self, adapter: LoRAAdapter, request: LoRARequest) -> None:
        """An adapter of a checkpoint that fuses q/k/v or gate/up (Phi-3 targets
        ``qkv_proj``, ``gate_up_proj``): its B split by the model's slices, each slice
        with the same A (``B @ A`` restricted to the slice's rows)."""
        for i, target in [k for k in adapter.weights if k[1] in ("qkv_proj", "gate_up_proj")]:
            a, b = adapter.weights.pop((i, target))
            layer = self.layers.get((i, target))
            if layer is None or b.shape[0] != sum(layer.slices):
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r}: layer {i}'s {target} "
                    f"({b.shape[0]} outputs) does not match the model"
                )
            for part, rows in zip(_FUSED[target], b.split(layer.slices), strict=True):
                if (i, part) in adapter.weights:
                    raise ValueError(
                        f"LoRA adapter {request.lora_name!r} targets layer {i}'s {target} "
                        f"and its {part}"
                    )
                adapter.weights[(i, part)] = (a, rows)

    def _check_fits(self, adapter: LoRAAdapter, request: LoRARequest) -> None:
        wrapped = {(i, t): self.layers[(i, attr)] for (i, attr) in self.layers
                   for t in _FUSED[attr]}  # fmt: skip
        for (i, target), (a, b) in adapter.weights.items():
            layer = wrapped.get((i, target))
            if layer is None:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} targets layer {i}'s {target}, which "
                    "this model does not have as a dense layer"
                )
            attr = next(k for k, v in _FUSED.items() if target in v)
            width = layer.slices[_FUSED[attr].index(target)]
            if a.shape[1] != layer.lora_a.shape[1] or b.shape[0] != width:
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r}: layer {i}'s {target} is "
                    f"{tuple(b.shape[:1]) + tuple(a.shape[1:])} (out, in), the model's is "
                    f"({width}, {layer.lora_a.shape[1]})"
                )

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        for (i, attr), layer in self.layers.items():
            layer.set_slot(slot, [adapter.weights.get((i, t)) for t in _FUSED[attr]])

    def set_token_slots(self, slots: list[int], device) -> None:
        """The step's slot of every token row (0: the base model); all zero: no update."""
        self.batch.set(slots, device)
