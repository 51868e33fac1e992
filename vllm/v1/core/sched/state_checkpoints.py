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

With the CPU KV tier (``--kv-offloading-size``), checkpoints have a host tier too: a
checkpoint evicted from its device slot is first copied to a host slot (an *offload*:
``SchedulerOutput.state_offloads``, run before the forward, so before the slot is
rewritten after it), under the same block hash, host slots LRU-evicted in turn. A prefix
hit then reaches as far as the deepest checkpoint on either side; one in host memory is
copied straight into the request's state slot (``StateRestore.host``), its host slot held
until the step's plan is taken so that no offload of the same step overwrites it. That is
what ContextServe's offload of a slow tool's job needs on these models: its blocks go to
the KV tier, and its states follow them there once the device's slots are wanted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.stats import StateCheckpointStats


@dataclass(frozen=True)
class StateRestore:
    """Where a request's states start from: checkpoint ``slot`` of the device's
    checkpoints, or of the host tier's (``host``)."""

    slot: int
    host: bool = False


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
        self,
        num_slots: int,
        block_size: int,
        is_pinned: Callable[[str], bool] = lambda j: False,
        num_host_slots: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots: {num_slots}, must be >= 1")
        if num_host_slots < 0:
            raise ValueError(f"num_host_slots: {num_host_slots}, must be >= 0")
        self.num_slots = num_slots
        self.num_host_slots = num_host_slots
        self._host_free = list(range(num_host_slots - 1, -1, -1))
        self._host: OrderedDict[Any, int] = OrderedDict()  # block hash -> host slot, LRU first
        self._host_held: set[int] = set()  # read by a restore of this step's plan
        self._offloads: list[tuple[int, int]] = []  # this step's (device slot, host slot)
        self.offloads = 0
        self.block_size = block_size
        self.is_pinned = is_pinned  # whether a job holds a pin (its entries are kept longer)
        self._free = list(range(num_slots - 1, -1, -1))
        self._cache: OrderedDict[Any, _Entry] = OrderedDict()  # block hash -> entry, LRU first
        self._running: dict[str, _Held] = {}
        self.restores = self.saves = self.evictions = 0  # totals, for tests and logs
        self._reported = (0, 0, 0, 0)  # the totals at the last take_stats

    def __len__(self) -> int:
        """Checkpoints in the (device) cache."""
        return len(self._cache)

    @property
    def num_offloaded(self) -> int:
        """Checkpoints in the host tier."""
        return len(self._host)

    # -- a request's prefix hit ----------------------------------------------------------
    def hit(self, block_hashes: list, num_hit: int) -> tuple[int, StateRestore | None]:
        """The longest prefix within ``num_hit`` tokens (a whole number of blocks) that
        ends on a checkpoint, on the device or in the host tier (the device's first at the
        same depth): (its tokens, where to restore from), or (0, None). Call ``use`` once
        the request is admitted."""
        for k in range(num_hit // self.block_size, 0, -1):
            key = block_hashes[k - 1]
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return k * self.block_size, StateRestore(entry.slot)
            host_slot = self._host.get(key)
            if host_slot is not None:
                self._host.move_to_end(key)
                return k * self.block_size, StateRestore(host_slot, host=True)
        return 0, None

    def use(self, restore: StateRestore) -> None:
        """A request admitted with ``restore`` (from ``hit``): counted, and a host slot held
        until the step's plan is taken (its copy runs before any later offload)."""
        self.restores += 1
        if restore.host:
            self._host_held.add(restore.slot)

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
        """Drop the cache's checkpoints and the host tier's (a prefix-cache reset, between
        steps); running requests keep theirs."""
        self._free += [e.slot for e in self._cache.values()]
        self._cache.clear()
        self._host_free += self._host.values()
        self._host.clear()

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
        slot = self._cache.pop(victim).slot
        self._offload(victim, slot)
        return slot

    # -- the host tier -------------------------------------------------------------------
    def _offload(self, key: Any, slot: int) -> None:
        """An evicted checkpoint (device ``slot``, reused after this step's forward) to the
        host tier: copied before the forward, unless the tier has it (it becomes the most
        recent) or every host slot is held."""
        if not self.num_host_slots:
            return
        if key in self._host:
            self._host.move_to_end(key)
            return
        if self._host_free:
            host_slot = self._host_free.pop()
        else:
            old = next((k for k, s in self._host.items() if s not in self._host_held), None)
            if old is None:
                return
            host_slot = self._host.pop(old)
        self._host[key] = host_slot
        self._offloads.append((slot, host_slot))
        self.offloads += 1

    def take_offloads(self) -> list[tuple[int, int]]:
        """This step's copies to the host tier, (device slot, host slot) each, to run before
        its forward; the host slots its restores read are released (they run first too)."""
        offloads, self._offloads = self._offloads, []
        self._host_held.clear()
        return offloads

    def discard_offloads(self, offloads: list[tuple[int, int]]) -> None:
        """The step that was to run ``offloads`` failed: those host slots may hold anything,
        so their checkpoints are forgotten (a lost hit, never a wrong state)."""
        lost = {host_slot for _, host_slot in offloads}
        for key in [k for k, s in self._host.items() if s in lost]:
            self._host_free.append(self._host.pop(key))

    def take_stats(self) -> StateCheckpointStats:
        """The caches' sizes, and the counters since the previous call."""
        totals = (self.saves, self.restores, self.evictions, self.offloads)
        deltas = [now - then for now, then in zip(totals, self._reported, strict=True)]
        self._reported = totals
        return StateCheckpointStats(len(self._cache), *deltas[:3], len(self._host), deltas[3])

    def check_invariants(self) -> None:
        """Every slot in exactly one place: free, a running request's, or the cache's; every
        host slot free or the host tier's, held ones the tier's."""
        slots = self._free + [s for held in self._running.values() for s in held.slots()]
        slots += [e.slot for e in self._cache.values()]
        assert sorted(slots) == list(range(self.num_slots)), slots
        host = self._host_free + list(self._host.values())
        assert sorted(host) == list(range(self.num_host_slots)), host
        assert self._host_held <= set(self._host.values()), self._host_held
