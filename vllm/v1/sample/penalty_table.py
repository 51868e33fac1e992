"""Repetition, frequency and presence penalties from token tables kept on the device.

The sampler's sparse way (``sampler.apply_penalties_to_rows`` without a table) builds
every penalised row's history on the host each step, a (row, token) entry per distinct
prompt id and per output token (11.8 ms a step for 256 rows of 2k-token prompts on this
project's EPYC), copies it up, and needs each row's output up to the step: with
--async-scheduling a step with such rows first waits for the step before it on the
device. Models whose generation config asks a repetition penalty (Qwen2.5-Instruct:
1.05) put every request there.

A ``PenaltyTable`` keeps, for each request with a penalty, on the device:
- a row over the vocabulary of whether each token is in its prompt (bool) and of how many
  times it is in the output (int32): a token's penalty from its own two entries;
- a list of the tokens it has met: its prompt's distinct ids, then each output token.
A request's row is filled once, when the runner adds it (its prompt, the output it
resumes with after a preemption); each token sampled for it after that is appended and
counted on the device, from the sampled tokens themselves (``record_on_device``), so a
deferred step's penalties need nothing from the host but how long each list is.

Applying the penalties touches only the batch's listed tokens (a gather and a scatter of
the logits there), as the sparse way does, and is bit for bit its arithmetic. A list
read past its end (the batch's longest sets the width) holds some token id of the
vocabulary, whose value the same arithmetic, from that token's own entries, gives
correctly too: every write of a token writes the same value.

The runner keeps one on every device (``ModelRunner.use_penalty_tables``): on a CPU a
sampled step costs the same either way (``benchmarks/benchmark_sampler.py
--penalty-table-ab``), and the CPU's tests then run the GPU's way. A row costs 5 bytes a
token of the vocabulary (640 KiB for Llama-3's 128k) and 4 a listed token; both grow by
doubling and rows are kept for reuse.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from vllm.sampling_params import SamplingParams
from vllm.utils.device import to_device, upload


def has_penalty(p: SamplingParams) -> bool:
    """Whether a request asks a repetition, frequency or presence penalty."""
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


class PenaltyTable:
    """Each penalised request's prompt tokens, output counts and met tokens, one row each,
    on ``device`` (the sampler's logits' device) over a ``vocab``-token vocabulary."""

    def __init__(
        self, vocab: int, device: torch.device | str, capacity: int = 8, width: int = 256
    ) -> None:
        if vocab < 1:
            raise ValueError(f"vocab must be positive, got {vocab}")
        if capacity < 1 or width < 1:
            raise ValueError(f"capacity and width must be positive, got {capacity}, {width}")
        self.vocab = vocab
        self.device = torch.device(device)
        self.in_prompt = torch.zeros((capacity, vocab), dtype=torch.bool, device=self.device)
        self.counts = torch.zeros((capacity, vocab), dtype=torch.int32, device=self.device)
        # Row i's first lengths[i] entries: the tokens it has met (ids past them: any in range).
        self.met = torch.zeros((capacity, width), dtype=torch.int32, device=self.device)
        self.lengths = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() takes the lowest row

    @property
    def capacity(self) -> int:
        return self.in_prompt.shape[0]

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def add(self, prompt_ids: np.ndarray | Sequence[int], output_ids: Sequence[int]) -> int:
        """A row for a request: its prompt's ids (repeats allowed) and the output it already
        has, copied up in one go without waiting for the device. Returns the row's slot."""
        prompt = np.unique(np.asarray(prompt_ids, dtype=np.int64))
        output = np.asarray(output_ids, dtype=np.int64)
        met = np.concatenate([prompt, output])
        if len(met) and not (0 <= met.min() and met.max() < self.vocab):
            raise ValueError(
                f"token ids must be in [0, {self.vocab}): got {met.min()} to {met.max()}"
            )
        if not self._free:
            self._grow_rows()
        self._widen(len(met))
        slot = self._free.pop()
        self.in_prompt[slot].zero_()
        self.counts[slot].zero_()
        self.lengths[slot] = len(met)
        if len(met):
            ids = upload(torch.from_numpy(met), self.device)
            self.met[slot, : len(met)] = ids
            self.in_prompt[slot].index_fill_(0, ids[: len(prompt)], True)
            out = ids[len(prompt) :]
            self.counts[slot].index_put_((out,), torch.ones_like(out, dtype=torch.int32),
                                         accumulate=True)  # fmt: skip
        return slot

    def remove(self, slot: int) -> None:
        """Give a request's row back (finished, aborted or preempted)."""
        if not 0 <= slot < self.capacity or slot in self._free:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    def record(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        """Count one sampled token (known on the host) for each row of ``slots``."""
        if len(slots):
            self.record_on_device(slots, to_device(tokens, torch.long, self.device))

    def record_on_device(
        self, slots: Sequence[int], tokens: torch.Tensor, keep: torch.Tensor | None = None
    ) -> None:
        """Append and count one token for each row of ``slots`` (distinct), ``tokens`` on
        the device: a step's, still there (--async-scheduling). ``keep`` (bool, one per
        row): False for a row whose sampling failed, whose token is not its request's (it
        is listed, not counted: a listed token is only a place to look)."""
        if not len(slots):
            return
        where = [self.lengths[s] for s in slots]
        self._widen(max(where) + 1)
        for s in slots:
            self.lengths[s] += 1
        index = to_device([list(slots), where], torch.long, self.device)
        self.met.index_put_((index[0], index[1]), tokens.int())
        add = torch.ones_like(tokens, dtype=torch.int32) if keep is None else keep.int()
        self.counts.index_put_((index[0], tokens), add, accumulate=True)

    def apply(
        self, x: torch.Tensor, rows: Sequence[int], slots: Sequence[int],
        params: Sequence[SamplingParams],
    ) -> torch.Tensor:  # fmt: skip
        """``x`` (rows, vocab, contiguous) with the penalties of its ``rows`` applied in
        place, row ``rows[i]`` being the request in ``slots[i]`` with ``params[i]``; vLLM's
        order and the sparse way's arithmetic: repetition (a token in the prompt or the
        output: positive logits divided by it, negative ones multiplied), then frequency
        and presence (the count times the one, plus the other, for a token in the
        output). A factor of 1 and penalties of 0 leave a value as it is, to the bit."""
        if x.shape[-1] != self.vocab:
            raise ValueError(f"logits have {x.shape[-1]} tokens, the table {self.vocab}")
        width = max((self.lengths[s] for s in slots), default=0)
        if not width:  # no prompt, no output: nothing to penalise
            return x
        dtype, device = x.dtype, x.device
        index = to_device([list(rows), list(slots)], torch.long, device)
        ids = self.met.index_select(0, index[1])[:, :width].long()  # (n, width)
        at_x = (index[0, :, None] * self.vocab + ids).view(-1)
        at_table = (index[1, :, None] * self.vocab + ids).view(-1)
        flat = x.view(-1)
        values = flat.index_select(0, at_x)
        counts = self.counts.view(-1).index_select(0, at_table)
        in_output = counts > 0
        n = len(slots)
        if any(p.repetition_penalty != 1.0 for p in params):
            factor = to_device([p.repetition_penalty for p in params], dtype, device)
            factor = factor[:, None].expand(n, width).reshape(-1)
            seen = self.in_prompt.view(-1).index_select(0, at_table) | in_output
            values = torch.where(
                seen, torch.where(values > 0, values / factor, values * factor), values
            )
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            both = to_device([[p.frequency_penalty for p in params],
                              [p.presence_penalty for p in params]], dtype, device)  # fmt: skip
            frequency, presence = both[:, :, None].expand(2, n, width).reshape(2, -1)
            values = torch.where(
                in_output, values - (frequency * counts.to(dtype) + presence), values
            )
        flat.index_put_((at_x,), values)  # a token listed twice gets the same value twice
        return x

    def _grow_rows(self) -> None:
        """Twice the rows, the old ones copied on the device (nothing waits)."""
        extra = self.capacity
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.met = torch.cat([self.met, torch.zeros_like(self.met)])
        self.lengths += [0] * extra
        self._free = list(range(2 * extra - 1, extra - 1, -1)) + self._free

    def _widen(self, width: int) -> None:
        """Lists at least ``width`` long (doubling), copied on the device."""
        if width <= self.met.shape[1]:
            return
        new = self.met.shape[1]
        while new < width:
            new *= 2
        wider = torch.zeros((self.capacity, new), dtype=self.met.dtype, device=self.device)
        wider[:, : self.met.shape[1]] = self.met
        self.met = wider
