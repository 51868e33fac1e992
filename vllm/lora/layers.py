"""A linear layer with the LoRA updates of every adapter slot, applied per token.

For ``max_loras`` slots of rank up to ``R`` over a layer fused from ``n`` slices (q/k/v:
3, gate/up: 2), the layer keeps::

    lora_a      (max_loras * n * R, in)    every slot's A matrices, stacked
    lora_bt     (max_loras * n * R, out)   every slot's B transposed, each slice's B in
                                           its own columns
    column_slot (max_loras * n * R,)       the slot (1..max_loras) of each column

and a step computes ``y = base(x) + ((x @ lora_a.T) * mask) @ lora_bt`` with ``mask``
keeping, on each token's row, the columns of that token's slot (slot 0: the base model,
no column). Two GEMMs for any mix of adapters, no gather and no per-adapter loop, over
the columns of the slots the step uses only (``n * R`` per slot: 48 for a rank-16 q/k/v
adapter), and no mask when every token of the step has the same adapter. Unused rows of
a slot (rank below ``R``) are zero.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.utils.device import pinned, to_device


class LoRABatch:
    """The step's adapter slot of every token, shared by all ``LoRALinear`` layers of a
    model (``set``). ``token_slots`` ``(num_tokens,)`` int64 on the device, or None when no
    token of the step has an adapter (the layers then add nothing); the layers compute only
    the slots ``lo..hi`` the step uses, and need no mask when every token has one adapter
    (``uniform``)."""

    def __init__(self, max_loras: int = 1) -> None:
        self.max_loras = max_loras
        self.token_slots: torch.Tensor | None = None
        self.lo = self.hi = 0
        self.uniform = False
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._graph_slots: torch.Tensor | None = None  # CUDA graphs' fixed slots buffer

    def set(self, slots: list[int], device) -> None:
        self._masks.clear()
        used = set(slots)
        active = used - {0}
        if not active:
            self.token_slots = None
            return
        self.token_slots = to_device(slots, torch.int64, device)
        self.lo, self.hi = min(active), max(active)
        self.uniform = len(used) == 1

    def use_graph_rows(self, size: int, max_size: int, device) -> None:
        """The state a captured decode step of ``size`` rows records and replays: every
        slot computed, masked by the slots in a fixed buffer (``fill_graph_rows``) so the
        same kernels serve any mix of adapters and base-model rows."""
        if self._graph_slots is None or self._graph_slots.shape[0] < max_size:
            self._graph_slots = torch.zeros(max_size, dtype=torch.int64, device=device)
        self._masks.clear()
        self.token_slots = self._graph_slots.narrow(0, 0, size)
        self.lo, self.hi, self.uniform = 1, self.max_loras, False

    def fill_graph_rows(self, slots: list[int]) -> None:
        """A replayed step's slot per row (padding rows: 0), into the fixed buffer."""
        assert self._graph_slots is not None, "use_graph_rows first"
        host = pinned(torch.tensor(slots, dtype=torch.int64))
        self._graph_slots.narrow(0, 0, len(slots)).copy_(host, non_blocking=True)

    def mask(self, width: int, column_slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``(num_tokens, columns)``: 1 where a column belongs to the token's slot; one per
        step and slot width (q/k/v, gate/up and single layers differ), shared by layers."""
        key = (width, dtype)
        if key not in self._masks:
            assert self.token_slots is not None
            self._masks[key] = (self.token_slots[:, None] == column_slot[None, :]).to(dtype)
        return self._masks[key]


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
        self.register_buffer("lora_bt", torch.zeros(cols, sum(slices), dtype=dtype, device=device))
        slot_of_col = torch.arange(1, max_loras + 1, device=device).repeat_interleave(width)
        self.register_buffer("column_slot", slot_of_col)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        b = self.batch
        if b.token_slots is None:
            return y
        cols = slice((b.lo - 1) * self.slot_width, b.hi * self.slot_width)  # slots used
        a = self.lora_a[cols]
        t = x.to(a.dtype) @ a.t()  # (T, cols); x may be a bf16 prefill product (gguf)
        if not b.uniform:
            t = t * b.mask(self.slot_width, self.column_slot[cols], t.dtype)
        if y.dtype != t.dtype:  # a gguf layer keeping its bf16 prefill product
            return y + (t @ self.lora_bt[cols]).to(y.dtype)
        return torch.addmm(y, t, self.lora_bt[cols])

    @torch.no_grad()
    def set_slot(self, slot: int, weights: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot ``slot`` (1-based) takes ``weights[i]`` = (A ``(r, in)``, B ``(out_i, r)``)
        for slice ``i`` (None: that slice has no update); the rest of the slot is zeroed."""
        start = (slot - 1) * self.slot_width
        self.lora_a[start : start + self.slot_width].zero_()
        self.lora_bt[start : start + self.slot_width].zero_()
        for i, pair in enumerate(weights):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            col = start + i * self.max_rank
            self.lora_a[col : col + r].copy_(a)
            out = slice(self.offsets[i], self.offsets[i] + self.slices[i])
            self.lora_bt[col : col + r, out].copy_(b.t())
