"""A linear layer with the LoRA updates of every adapter slot, applied per token.

For ``max_loras`` slots of rank up to ``R`` over a layer fused from ``n`` slices (q/k/v:
3, gate/up: 2), the layer keeps::

    lora_a      (max_loras * n * R, in)    every slot's A matrices, stacked
    lora_b      (out, max_loras * n * R)   every slot's B, each slice's in its own rows
    column_slot (max_loras * n * R,)       the slot (1..max_loras) of each column

and a step computes ``y = base(x) + ((x @ lora_a.T) * mask) @ lora_b.T`` with ``mask``
keeping, on each token's row, the columns of that token's slot (slot 0: the base model,
no column). Two GEMMs for any mix of adapters, no gather and no per-adapter loop: the
extra width is ``max_loras * n * R`` columns (64 for one rank-16 q/k/v adapter), small
beside the layer's own. Unused rows of a slot (rank below ``R``) are zero.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRABatch:
    """The step's adapter slot of every token, shared by all ``LoRALinear`` layers of a
    model: ``token_slots`` ``(num_tokens,)`` int64 on the device, or None when no token of
    the step has an adapter (the layers then add nothing)."""

    def __init__(self) -> None:
        self.token_slots: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """``base`` (any module mapping ``(T, in)`` to ``(T, out)``) plus the slots' updates.
    ``slices``: the output widths of the fused projections, in order."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        slices: list[int],
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.offsets = [sum(slices[:i]) for i in range(len(slices))]
        self.max_rank = max_rank
        self.batch = batch
        width = len(slices) * max_rank  # columns of one slot
        self.slot_width = width
        cols = max_loras * width
        self.register_buffer("lora_a", torch.zeros(cols, in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(sum(slices), cols, dtype=dtype, device=device))
        slot_of_col = torch.arange(1, max_loras + 1, device=device).repeat_interleave(width)
        self.register_buffer("column_slot", slot_of_col)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.batch.token_slots
        if slots is None:
            return y
        t = x @ self.lora_a.t()  # (T, cols)
        t = t * (slots[:, None] == self.column_slot[None, :]).to(t.dtype)
        return torch.addmm(y, t, self.lora_b.t())

    @torch.no_grad()
    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot ``slot`` (1-based) takes ``weights[i]`` = (A ``(r, in)``, B ``(out_i, r)``)
        for slice ``i`` (None: that slice has no update); the rest of the slot is zeroed."""
        start = (slot - 1) * self.slot_width
        self.lora_a[start : start + self.slot_width].zero_()
        self.lora_b[:, start : start + self.slot_width].zero_()
        for i, pair in enumerate(weights):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            col = start + i * self.max_rank
            self.lora_a[col : col + r].copy_(a)
            rows = slice(self.offsets[i], self.offsets[i] + self.slices[i])
            self.lora_b[rows, col : col + r].copy_(b)
