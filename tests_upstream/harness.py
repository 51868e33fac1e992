"""Build our scheduler subclass over upstream's, step it with a fake model runner, and check
upstream's block pool after every step."""

from __future__ import annotations

from collections import Counter

from conftest import BLOCK_SIZE, make_request

from vllm_continuum.clock import FakeClock
from vllm_continuum.config import PolicyConfig

TOOL_TEXT = "```bash\nls -la\n```"  # what every finished turn "says": a fast tool call


def make_scheduler(
    vllm_config,
    num_blocks=33,
    max_num_seqs=8,
    clock=None,
    text=TOOL_TEXT,
    cls=None,
    context_serve=None,
    **cfg,
):
    """``num_blocks`` includes upstream's null block. Default policy settings: the paper
    rule at cold start, i.e. every named non-last turn is pinned for default_ttl_s = 2 s;
    job admission off (these scenarios test the mechanism; test_admission.py turns it
    on). ``cls``: the scheduler class (default ``ContinuumScheduler``);
    ``context_serve``: a ``ContextServeConfig`` (then ``ContextServeScheduler``); ``text``:
    what every finished turn says, or a function of its output token ids."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from vllm.v1.structured_output import StructuredOutputManager
    from vllm_continuum.upstream.scheduler import ContinuumScheduler

    extra = {}
    if context_serve is not None:
        from vllm_continuum.upstream.context_serve import ContextServeScheduler

        cls, extra = cls or ContextServeScheduler, {"context_serve_config": context_serve}
    cfg.setdefault("job_admission", False)

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    s = (cls or ContinuumScheduler)(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
        clock=clock or FakeClock(0.0),
        decode=text if callable(text) else (lambda ids: text),
        policy_config=PolicyConfig(**cfg),
        **extra,
    )
    s.max_num_running_reqs = s.max_num_active_reqs = max_num_seqs
    return s


def fake_output(s, so):
    """The fake forward of ``so``, taken right after it was scheduled: one token for each
    request whose prefill this step completes or which decodes."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=[[] if s.requests[rid].is_prefill_chunk else [7] for rid in req_ids],
    )


def step(s):
    """One engine step: schedule, a fake forward, update; then the pool check. Returns
    (scheduler_output, engine outputs)."""
    so = s.schedule()
    outputs = s.update_from_output(so, fake_output(s, so))
    check_pool(s)
    return so, outputs


def run_until_done(s, max_steps=200, tick=0.0):
    """Step until every request is done; ``tick``: seconds the clock advances per step."""
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return
        s.clock.advance(tick)
        step(s)
    raise AssertionError("requests did not finish")


class Pipeline:
    """Async scheduling's order (upstream's batch queue of two): each step is scheduled
    before the previous step's output is processed; the pool check after every update."""

    def __init__(self, s):
        self.s = s
        self.in_flight = None

    def step(self):
        so = self.s.schedule()
        out = fake_output(self.s, so)
        if self.in_flight is not None:
            self.s.update_from_output(*self.in_flight)
            check_pool(self.s)
        self.in_flight = (so, out) if so.total_num_scheduled_tokens else None
        return so

    def run_until_done(self, max_steps=200, tick=0.0):
        for _ in range(max_steps):
            if self.in_flight is None and not self.s.has_unfinished_requests():
                return
            self.s.clock.advance(tick)
            self.step()
        raise AssertionError("requests did not finish")


def random_traffic(s, rng, num_steps, pipeline=None, drain_tick=0.0):
    """Random multi-turn jobs (6 jobs, 20% last steps), tool gaps of 0 to 3 s, aborts
    (5% of steps) and memory pressure, one ``step`` (with its pool check) per iteration,
    or one ``pipeline`` step; then runs until every request is done, the clock advancing
    ``drain_tick`` per step (job admission may hold a new job until pins expire)."""
    from vllm.v1.request import RequestStatus

    contexts: dict[str, list[int]] = {}
    live = []
    for _ in range(num_steps):
        if rng.random() < 0.3:
            job = f"j{rng.randrange(6)}"
            prompt = contexts.get(job, [rng.randrange(1000) for _ in range(rng.randrange(5, 40))])
            r = make_request(
                [*prompt, rng.randrange(1000)],
                job=job,
                last=rng.random() < 0.2,
                max_tokens=rng.randrange(1, 12),
            )
            s.add_request(r)
            live.append((job, r))
        if live and rng.random() < 0.05:
            _, victim = live.pop(rng.randrange(len(live)))
            s.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
        s.clock.advance(rng.choice([0.0, 0.05, 0.5, 3.0]))
        pipeline.step() if pipeline else step(s)
        for job, r in [x for x in live if x[1].is_finished()]:
            live.remove((job, r))
            if len(r.all_token_ids) < 120:
                contexts[job] = list(r.all_token_ids)
    if pipeline:
        pipeline.run_until_done(max_steps=2000, tick=drain_tick)
    else:
        run_until_done(s, max_steps=2000, tick=drain_tick)


def check_pool(s):
    """Block conservation in upstream's pool: every block's ref_cnt equals the number of
    requests (live or pinned) holding it; ref_cnt 0 iff free; only live and pinned
    requests hold blocks; the pin table's block count is exact."""
    kv = s.kv_cache_manager
    pool = kv.block_pool
    holders: Counter[int] = Counter()
    owners = set()
    for manager in kv.coordinator.single_type_managers:
        for rid, blocks in manager.req_to_blocks.items():
            real = [b for b in blocks if not b.is_null]
            if real:
                owners.add(rid)
            holders.update(b.block_id for b in real)
    pinned = {e.request.request_id: e for e in s.pins.entries()}
    assert owners <= set(s.requests) | set(pinned), owners - set(s.requests) - set(pinned)
    assert not set(pinned) & set(s.requests)
    num_free = 0
    for block in pool.blocks:
        if block.is_null:
            continue
        assert block.ref_cnt == holders[block.block_id], (block.block_id, block.ref_cnt)
        num_free += block.ref_cnt == 0
    assert pool.get_num_free_blocks() == num_free
    assert s.pins.num_blocks == sum(e.num_blocks for e in pinned.values())
    for rid, entry in pinned.items():
        assert entry.num_blocks == s.num_blocks(rid) > 0


def used_blocks(s):
    pool = s.kv_cache_manager.block_pool
    return len(pool.blocks) - 1 - pool.get_num_free_blocks()


def upstream_parser():
    """Upstream's own CLI parser (building it loads the general plugins: ours too)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
