"""The states of recurrent (linear-attention) layers: what a hybrid model's Gated DeltaNet
layers (Qwen3-Next, Qwen3.5) keep per sequence in place of a KV cache.

A linear-attention layer folds a sequence's past into a fixed-size state: its causal
convolution's last ``kernel - 1`` inputs, and the delta rule's ``(heads, k_dim, v_dim)``
matrix. Unlike K/V, the state after ``n`` tokens cannot be rebuilt from blocks, so it is
not paged: the model runner keeps a pool of ``num_slots`` states per recurrent layer (one
slot a running request, as vLLM's Mamba cache in its first form), gives a request a slot
when it is scheduled and takes it back when the request finishes or is preempted (a
preempted request recomputes from its first token, as it would without prefix caching).

The model declares its states (``recurrent_state_specs``: per recurrent layer, a tuple
of ``StateSpec``) and its ``forward`` takes ``recurrent=RecurrentBatch``: the step's
sequences in row order (tokens each, whether each starts from nothing) and their slots.
A layer reads a sequence's state from its slot unless the sequence is ``fresh`` (its
first chunk: the slot may hold a finished request's state, never read), and writes the
state after the sequence's last token of the step back to the slot. Without a batch
(the profile run, kernel warm-ups) the model treats its rows as one fresh sequence over
scratch states (``RecurrentBatch.scratch``).

A step is served the same way by every layer (``RecurrentStep``, worked out once): the
decodes (one token, a state to continue) in one batched update, prefill chunks and fresh
sequences one at a time.

Speculative decoding: a sequence that verifies drafts (``drafted``) runs its last token
and its ``k`` drafts one position at a time, position ``t`` of every such sequence in one
batched update as the decodes are, and its states after each of the first ``k`` are kept
(``keep``) until the drafts are judged; when only ``a`` of them are accepted,
``roll_back`` puts the states after ``1 + a`` tokens back into its slot (the slot holds
those after all ``k + 1``). vLLM keeps ``k + 1`` states a request for the same reason;
here they live only for the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a recurrent layer, per sequence: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def state_bytes(specs: Sequence[Sequence[StateSpec]]) -> int:
    """Bytes of one sequence's states over every recurrent layer."""
    return sum(s.nbytes() for layer in specs for s in layer)


def allocate_states(
    specs: Sequence[Sequence[StateSpec]], num_slots: int, device: torch.device | str
) -> list[tuple[torch.Tensor, ...]]:
    """Per recurrent layer, its states for ``num_slots`` sequences: ``(num_slots, *shape)``
    each, zeroed."""
    return [
        tuple(torch.zeros((num_slots, *s.shape), dtype=s.dtype, device=device) for s in layer)
        for layer in specs
    ]


@dataclass
class RecurrentBatch:
    """A step's sequences as the recurrent layers see them, in the order of the step's
    rows: sequence ``i`` owns rows ``starts[i] : starts[i] + query_lens[i]``."""

    query_lens: list[int]  # each sequence's tokens this step
    fresh: list[bool]  # True: the sequence starts here (no state to read)
    slot_ids: list[int]  # each sequence's slot in the pools
    states: list[tuple[torch.Tensor, ...]]  # per recurrent layer: its pools (num_slots, ...)
    # Speculative decoding: whether each sequence verifies drafts (empty: none does).
    drafted: list[bool] = field(default_factory=list)
    slots: torch.Tensor = field(init=False)  # slot_ids on the pools' device (long)
    starts: list[int] = field(init=False)  # each sequence's first row
    # A drafted sequence's first snapshot (its states after its first token; -1: none).
    snapshot_base: list[int] = field(init=False)
    num_snapshots: int = field(init=False)
    # id(pool) -> (num_snapshots, ...) copies of its slots, made on a layer's first snapshot
    _snapshots: dict[int, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.drafted = self.drafted or [False] * len(self.query_lens)
        if not (len(self.query_lens) == len(self.fresh) == len(self.slot_ids) == len(self.drafted)):
            raise ValueError(
                "query_lens, fresh, slot_ids and drafted must have one entry a sequence"
            )
        device = self.states[0][0].device if self.states else "cpu"
        self.slots = torch.tensor(self.slot_ids, dtype=torch.long, device=device)
        starts, row = [], 0
        for n in self.query_lens:
            starts.append(row)
            row += n
        self.starts = starts
        self.snapshot_base, k = [], 0
        for n, drafted in zip(self.query_lens, self.drafted, strict=True):
            self.snapshot_base.append(k if drafted else -1)
            k += n - 1 if drafted else 0
        self.num_snapshots = k

    def keep(
        self, pools: tuple[torch.Tensor, ...], slots: torch.Tensor, indices: torch.Tensor
    ) -> None:
        """Keep copies of ``slots`` of each of ``pools`` (a layer's) as the snapshots
        ``indices``."""
        for pool in pools:
            kept = self._snapshots.get(id(pool))
            if kept is None:
                kept = self._snapshots[id(pool)] = pool.new_empty(
                    (self.num_snapshots, *pool.shape[1:])
                )
            kept.index_copy_(0, indices, pool.index_select(0, slots))

    def roll_back(self, seq: int, accepted: int) -> None:
        """Drafted sequence ``seq`` keeps its last token and ``accepted`` drafts: its
        states after those ``1 + accepted`` tokens back into its slot (every layer's)."""
        if not self.drafted[seq]:
            raise ValueError(f"sequence {seq} verified no drafts")
        if accepted >= self.query_lens[seq] - 1:
            return  # every draft kept: the slot holds the states after them
        index, slot = self.snapshot_base[seq] + accepted, self.slot_ids[seq]
        for layer in self.states:
            for pool in layer:
                kept = self._snapshots.get(id(pool))
                if kept is not None:
                    pool[slot].copy_(kept[index])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def decode_only(self) -> bool:
        """Every sequence continues with one token: one batched recurrent step serves all."""
        return all(n == 1 for n in self.query_lens) and not any(self.fresh)

    @classmethod
    def scratch(
        cls, num_tokens: int, specs: Sequence[Sequence[StateSpec]], device: torch.device | str
    ) -> RecurrentBatch:
        """One fresh sequence over ``num_tokens`` rows, on states of its own (discarded):
        a forward with no engine batch (the profile run, a warm-up)."""
        return cls([num_tokens], [True], [0], allocate_states(specs, 1, device))


class Chunk(NamedTuple):
    """A sequence's rows that a recurrent layer runs as one chunk (``RecurrentStep``)."""

    start: int  # its first row
    n: int  # its tokens
    slot: int
    fresh: bool


class DecodeGroup(NamedTuple):
    """Rows that a recurrent layer updates in one batch, a token each (``RecurrentStep``):
    the step's decodes, or one position of the sequences that verify drafts."""

    rows: torch.Tensor | None  # (n,) long on the pools' device; None: every row
    slots: torch.Tensor  # (n,) long: each row's slot
    keep: torch.Tensor | None = None  # the snapshots the states after it go to (drafts)


@dataclass(frozen=True)
class RecurrentStep:
    """How a step's sequences are served (module docstring), worked out once from its
    ``RecurrentBatch`` for every layer: ``groups`` a token a row in batched updates, in
    order (the decodes, then the drafted sequences' positions), ``prefills`` one chunk at
    a time. A layer runs ``groups`` through its decode update and calls ``after`` on each
    (the drafts' snapshots), then its prefills."""

    groups: tuple[DecodeGroup, ...]
    prefills: tuple[Chunk, ...]
    batch: RecurrentBatch | None = None

    @property
    def decode_only(self) -> bool:
        """One group over every row: the layer's decode update is the whole step."""
        return len(self.groups) == 1 and self.groups[0].rows is None

    def after(self, group: DecodeGroup, *pools: torch.Tensor) -> None:
        """A layer ran ``group`` on ``pools``: the states it asks to keep, kept."""
        if group.keep is not None and self.batch is not None:
            self.batch.keep(pools, group.slots, group.keep)

    @classmethod
    def of_forward(
        cls, batch: RecurrentBatch | None, model: nn.Module, x: torch.Tensor
    ) -> tuple[RecurrentBatch, RecurrentStep]:
        """A forward's batch and its plan: ``batch``, or without one (the profile run, a
        warm-up) every row of ``x`` one fresh sequence on scratch states of ``model``'s
        specs (``recurrent_state_specs`` in its embeddings' dtype)."""
        if batch is None:
            specs = model.recurrent_state_specs(model.embed_tokens.weight.dtype)
            batch = RecurrentBatch.scratch(x.shape[0], specs, x.device)
        return batch, cls.of(batch)

    @classmethod
    def of(cls, batch: RecurrentBatch) -> RecurrentStep:
        if batch.decode_only:  # no host work beyond the batch's own lists
            return cls((DecodeGroup(None, batch.slots),), ())
        decodes: list[tuple[int, int]] = []  # (row, slot)
        drafted: list[list[tuple[int, int, int]]] = []  # per position: (row, slot, keep)
        prefills = []
        seqs = zip(batch.starts, batch.query_lens, batch.slot_ids, batch.fresh, batch.drafted,
                   batch.snapshot_base, strict=True)  # fmt: skip
        for start, n, slot, fresh, verifies, base in seqs:
            if verifies:  # a position at a time; the states after all but the last kept
                for t in range(n):
                    if len(drafted) <= t:
                        drafted.append([])
                    drafted[t].append((start + t, slot, base + t if t < n - 1 else -1))
            elif n == 1 and not fresh:
                decodes.append((start, slot))
            elif n > 0:
                prefills.append(Chunk(start, n, slot, fresh))
        device = batch.slots.device

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        groups = []
        if decodes:
            groups.append(
                DecodeGroup(longs([r for r, _ in decodes]), longs([s for _, s in decodes]))
            )
        for position in drafted:  # in order: a sequence's position t before its t + 1
            for kept in (True, False):  # its states kept (a draft follows) or not
                part = [p for p in position if (p[2] >= 0) == kept]
                if part:
                    groups.append(DecodeGroup(
                        longs([r for r, _, _ in part]), longs([s for _, s, _ in part]),
                        longs([k for _, _, k in part]) if kept else None,
                    ))  # fmt: skip
        return cls(tuple(groups), tuple(prefills), batch)


def has_recurrent_layers(hf_config: object) -> bool:
    """The model class the registry runs ``hf_config`` with declares recurrent states
    (``recurrent_state_specs``: Qwen3-Next, Qwen3.5); False for an architecture it does
    not run (the engine's start says why)."""
    from vllm.model_executor.models.registry import ModelRegistry

    try:
        model_cls, _ = ModelRegistry.resolve_model_cls(hf_config)
    except (ValueError, ImportError):
        return False
    return hasattr(model_cls, "recurrent_state_specs")


def ssm_state_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--mamba-ssm-cache-dtype``'s torch dtype: ``auto`` is the model's."""
    if name == "auto":
        return model_dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def copy_slots(
    src: Sequence[tuple[torch.Tensor, ...]],
    src_slots: Sequence[int],
    dst: Sequence[tuple[torch.Tensor, ...]],
    dst_slots: Sequence[int],
) -> None:
    """Copy the states of ``src_slots`` of pools ``src`` into ``dst_slots`` of ``dst``
    (per layer, the same specs): a checkpoint saved or restored, one gather and one
    scatter per state tensor. The pools may be on different devices (the CPU KV tier's
    host checkpoints): the gathered rows cross over between the two."""
    if not src_slots:
        return
    src_device, dst_device = src[0][0].device, dst[0][0].device
    from_idx = torch.tensor(list(src_slots), dtype=torch.long, device=src_device)
    to_idx = torch.tensor(list(dst_slots), dtype=torch.long, device=dst_device)
    for src_layer, dst_layer in zip(src, dst, strict=True):
        for a, b in zip(src_layer, dst_layer, strict=True):
            b.index_copy_(0, to_idx, a.index_select(0, from_idx).to(dst_device))


def split_tier(
    size_bytes: int, block_bytes: int, slot_bytes: int, device_blocks: int, device_slots: int
) -> tuple[int, int]:
    """A CPU KV tier of ``size_bytes`` for a model with recurrent layers: (KV blocks,
    checkpoint slots), in the device's own proportion of KV bytes to checkpoint bytes
    (``device_blocks`` of ``block_bytes``, ``device_slots`` of ``slot_bytes``), so that
    the tier holds about as many contexts' states as their blocks. (0, 0) when the share
    of checkpoints holds none: blocks without states are no hit."""
    device_bytes = device_blocks * block_bytes + device_slots * slot_bytes
    slots = size_bytes * device_slots // device_bytes
    if slots < 1:
        return 0, 0
    return (size_bytes - slots * slot_bytes) // block_bytes, slots


def refuse_unsupported(config: object) -> None:
    """``ValueError`` naming the flag a model with recurrent layers cannot serve with
    (``config``: a ``VllmConfig``): speculative decoding by a draft model or an EAGLE head
    (their proposers would need recurrent states of their own for the drafts, which they
    do not have here). N-gram and suffix drafts are verified with the states rolled back
    to the last token kept, and so are ``mtp``'s where the model's multi-token-prediction
    layer is attention only (Qwen3-Next's and Qwen3.5's: ``models/qwen3_next_mtp.py``): it
    drafts from the target's hidden states and its own KV, as an EAGLE head does, and
    keeps no recurrent state. Called before loading (EngineArgs, for a model
    ``has_recurrent_layers``) and after it (the runner, for a config built by hand)."""
    method = config.speculative_config.method
    if method is None or method in ("ngram", "suffix"):
        return
    if method == "mtp" and not _mtp_head_has_recurrent_layers(config):
        return
    raise ValueError(
        f"--speculative-config: method {method!r} is not served for a model with "
        "recurrent layers (linear attention, Mamba2, short convolutions); the methods "
        "'ngram' and 'suffix' are, and 'mtp' where the model's multi-token-prediction "
        "layer has attention layers only"
    )


def _mtp_head_has_recurrent_layers(config: object) -> bool:
    """Whether the MTP head ``config`` asks for keeps recurrent states; ValueError naming
    ``speculative_config.method`` for a model without an MTP layer."""
    from vllm.model_executor.model_loader import hf_config_of
    from vllm.model_executor.models.mtp import mtp_head_class

    return mtp_head_class(hf_config_of(config.draft_model_config)).recurrent_layers
