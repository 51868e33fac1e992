"""A scheduler with a CPU KV tier, driven by a fake runner that tracks block *contents*.

``FakeKV`` runs each step's copy plan and 'forward' on token tuples instead of tensors:
a save copies a KV cache block's tokens to a tier block, a load copies them back, and the
forward writes each scheduled token into its slot. After every step, every hashed block
of both tiers must hold exactly the tokens its hash names: a copy that ran in the wrong
order, read a stale block or an evicted tier block shows up as a mismatch.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

from ..core.sched.helpers import BLOCK, fake_output, make_scheduler


def make_offload_scheduler(num_cpu_blocks: int = 16, **kw) -> Scheduler:
    return make_scheduler(num_cpu_blocks=num_cpu_blocks, **kw)


class FakeKV:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.expected: dict[bytes, tuple] = {}  # block hash -> its tokens
        self.saved = self.loaded = 0

    def run(self, so: SchedulerOutput) -> None:
        """Execute ``so`` as the runner would: copies, then the forward; then check."""
        t = so.kv_transfers
        if t:
            for g, c in t.saves:
                self.cpu[c] = list(self.gpu[g])
            for c, g in t.loads:
                self.gpu[g] = list(self.cpu[c])
            self.saved += len(t.saves)
            self.loaded += len(t.loads)
        kv = self.sched.kv_cache_manager
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[req_id]
            (blocks,) = kv.get_block_ids(req_id)  # one KV cache group
            tokens = req.all_token_ids
            for pos in range(req.num_computed_tokens - n, req.num_computed_tokens):
                slots = self.gpu.setdefault(blocks[pos // BLOCK], [None] * BLOCK)
                slots[pos % BLOCK] = tokens[pos]
        self.check()

    def check(self) -> None:
        for req in self.sched.requests.values():
            toks = req.all_token_ids
            for i, h in enumerate(req.block_hashes):
                self.expected[h] = tuple(toks[i * BLOCK : (i + 1) * BLOCK])
        kv = self.sched.kv_cache_manager
        for block in kv.block_pool.blocks[1:]:
            if block.block_hash in self.expected:
                got = tuple(self.gpu.get(block.block_id, ()))
                assert got == self.expected[block.block_hash], f"{block}: holds {got}"
        if kv.offload is None:
            return  # no tier
        for h, c in kv.offload.pool._hash_to_id.items():
            if h in self.expected:
                got = tuple(self.cpu.get(c, ()))
                assert got == self.expected[h], f"tier block {c}: holds {got}"


def offload_step(sched: Scheduler, fkv: FakeKV, token: int = 7):
    so = sched.schedule()
    fkv.run(so)
    out = sched.update_from_output(so, fake_output(so, sched, token))
    sched.check_invariants()
    return so, out


def run_until_done(sched: Scheduler, fkv: FakeKV, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        offload_step(sched, fkv)
    raise AssertionError("requests did not finish")
