"""Prefix caching for models with recurrent layers: checkpoints of recurrent states
at block boundaries, the scheduler's side.

A prefix hit of ``k`` blocks gives a request the K/V of its first ``k * block_size``
tokens, but a recurrent layer (Qwen3.5's Gated DeltaNet, Mamba2) needs its state after
exactly those tokens, which no block holds. So the runner keeps copies of states, each
in a checkpoint slot (``ModelRunner.recurrent_checkpoints``), taken when a request's step
ends on a block boundary. A request keeps two:

- its prompt's: the state at the prompt's last block boundary before its last token
  (the deepest hit of the same prompt). The scheduler ends a prefill chunk there
  (``prompt_boundary``; the prompt's last tokens, at most a block, run in the next step).
  That copy is never overwritten: it enters the cache as soon as its step has run
  (``written``), for a request with the same prompt (forks, parallel samples, retries)
  while this one still runs;
- its latest: every later step that ends on a boundary (a decode every ``block_size``
  tokens) copies into one more slot, overwritten each time.

When the request ends (finished, aborted, preempted), what it holds enters the cache under
the hash of the block that ends at its position; a later request whose prefix hit reaches
such a block starts from a copy of it, its hit cut back to the deepest block that has
one (``hit``). That is the agent's case: a job's next turn repeats the last one's prompt
(and, when the template renders the answer back as it was generated, the answer), and
restarts from the deepest checkpoint instead of recomputing the whole history.

Slots: a running request takes its two as its checkpoints fall due and keeps its latest
to its end; the cache holds the rest, least recently used first out, except a pinned
job's (``Continuum`` pins a job's blocks for its next turn, which they serve only with
its states). When no slot is free and none can be evicted, the request goes without that
checkpoint. vLLM caches
Mamba states at block boundaries too (its "align" mode, the state stored in a block of
the mamba group); here the states have a pool of their own, sized in slots.

The runner learns per step which requests restore from which slot (before the forward,
``NewRequestData.state_restore``) and which checkpoint into which slot (after it,
``SchedulerOutput.state_checkpoints``); it runs the restores before the forward and the
checkpoints after it, so a slot evicted and reused in one step is read before written.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.stats import StateCheckpointStats


@dataclass
class _Entry:
    slot: int
    job: str  # the job of the request that made it (pinned jobs' entries go last)


@dataclass
class _Held:
    """A running request's checkpoints: (slot, position) each, or None."""

    prompt: tuple[int, int] | None = None
    latest: tuple[int, int] | None = None

    def slots(self) -> list[int]:
        return [c[0] for c in (self.prompt, self.latest) if c is not None]


def prompt_boundary(num_prompt_tokens: int, block_size: int) -> int:
    """The prompt's checkpoint's position (0: none): its last block boundary before its
    last token, the deepest a prefix hit of the same prompt can reach (a hit always
    leaves the last token to compute)."""
    return (num_prompt_tokens - 1) // block_size * block_size


class StateCheckpoints:
    """Checkpoint slots: each running request's own, and the cache of ended ones."""

    def __init__(
        self, num_slots: int, block_size: int, is_pinned: Callable[[str], bool] = lambda j: False
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: {num_slots}, must be >= 1")
        self.num_slots = num_slots
        self.block_size = block_size
        self.is_pinned = is_pinned  # whether a job holds a pin (its entries are kept longer)
        self._free = list(range(num_slots - 1, -1, -1))
        self._cache: OrderedDict[Any, _Entry] = OrderedDict()  # block hash -> entry, LRU first
        self._running: dict[str, _Held] = {}
        self.restores = self.saves = self.evictions = 0  # totals, for tests and logs
        self._reported = (0, 0, 0)  # the totals at the last take_stats

    def __len__(self) -> int:
        """Checkpoints in the cache."""
        return len(self._cache)

    # -- a request's prefix hit ----------------------------------------------------------
    def hit(self, block_hashes: list, num_hit: int) -> tuple[int, int | None]:
        """The longest prefix within ``num_hit`` tokens (a whole number of blocks) that
        ends on a checkpoint: (its tokens, the slot to restore from), or (0, None)."""
        for k in range(num_hit // self.block_size, 0, -1):
            entry = self._cache.get(block_hashes[k - 1])
            if entry is not None:
                self._cache.move_to_end(block_hashes[k - 1])
                return k * self.block_size, entry.slot
        return 0, None

    # -- a running request's steps -------------------------------------------------------
    def plan(self, req_id: str, end: int, num_prompt_tokens: int) -> int | None:
        """The request's step ends with ``end`` tokens computed: the slot its state is
        copied into after the step when ``end`` is a block boundary (its prompt's own at
        the prompt's last one, else its latest), else None (also when no slot can be
        had)."""
        if end % self.block_size:
            return None
        held = self._running.setdefault(req_id, _Held())
        if end == prompt_boundary(num_prompt_tokens, self.block_size):
            slot = self._take()
            if slot is not None:
                held.prompt = (slot, end)
                self.saves += 1
            return slot
        slot = held.latest[0] if held.latest is not None else self._take()
        if slot is not None:
            held.latest = (slot, end)
            self.saves += 1
        return slot

    def release(self, req_id: str, job: str, block_hashes: list, keep: bool) -> None:
        """The request ended (or was preempted): ``keep``, its checkpoint enters the
        cache under its block's hash (a prefix another checkpoint holds already keeps
        that one); otherwise (a failed request: its step's copy may not have run) its
        slot is freed. Only the slots of a step's requests are written in it, so a failed
        step's requests, all failed, leave no checkpoint behind."""
        held = self._running.pop(req_id, None)
        if held is None:
            return
        for checkpoint in (held.prompt, held.latest):  # the latest most recently used
            if checkpoint is None:
                continue
            if keep:
                self._insert(*checkpoint, job, block_hashes)
            else:
                self._free.append(checkpoint[0])

    def written(self, req_id: str, job: str, block_hashes: list) -> None:
        """The step that saved the request's checkpoints has run: its prompt's, which is
        never overwritten, enters the cache at once, so that a request with the same
        prompt (a fork, parallel samples, a retry) starts from it while this one still
        runs."""
        held = self._running.get(req_id)
        if held is None or held.prompt is None:
            return
        checkpoint, held.prompt = held.prompt, None
        self._insert(*checkpoint, job, block_hashes)

    def _insert(self, slot: int, position: int, job: str, block_hashes: list) -> None:
        """The checkpoint in ``slot`` at ``position`` into the cache, under the hash of the
        block ending there (a prefix another checkpoint holds keeps that one: ``slot`` is
        freed)."""
        blocks = position // self.block_size
        if blocks == 0 or blocks > len(block_hashes):
            self._free.append(slot)
            return
        key = block_hashes[blocks - 1]
        if key in self._cache:
            self._cache.move_to_end(key)
            self._free.append(slot)
            return
        self._cache[key] = _Entry(slot, job)

    def clear(self) -> None:
        """Drop the cache's checkpoints (a prefix-cache reset); running requests keep
        theirs."""
        self._free += [e.slot for e in self._cache.values()]
        self._cache.clear()

    # -- slots -------------------------------------------------------------------------
    def _take(self) -> int | None:
        """A free slot, else the least recently used checkpoint's whose job holds no pin;
        None when every cached one is a pinned job's. A pinned job's next turn is due
        (Continuum's prediction), and its pinned blocks are no hit without its states."""
        if self._free:
            return self._free.pop()
        victim = next((k for k, e in self._cache.items() if not self.is_pinned(e.job)), None)
        if victim is None:
            return None
        self.evictions += 1
        return self._cache.pop(victim).slot

    def take_stats(self) -> StateCheckpointStats:
        """The cache's size, and the counters since the previous call."""
        totals = (self.saves, self.restores, self.evictions)
        deltas = [now - then for now, then in zip(totals, self._reported, strict=True)]
        self._reported = totals
        return StateCheckpointStats(len(self._cache), *deltas)

    def check_invariants(self) -> None:
        """Every slot in exactly one place: free, a running request's, or the cache's."""
        slots = self._free + [s for held in self._running.values() for s in held.slots()]
        slots += [e.slot for e in self._cache.values()]
        assert sorted(slots) == list(range(self.num_slots)), slots
