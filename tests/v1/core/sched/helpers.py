"""Driving the scheduler with fake model outputs."""

from __future__ import annotations

from vllm.config import (
    CacheConfig,
    LoRAConfig,
    PolicyConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.utils.clock import FakeClock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.policy import create_policy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

BLOCK = 4


def make_scheduler(
    num_blocks: int = 33,
    max_num_seqs: int = 16,
    budget: int = 64,
    max_model_len: int = 128,
    policy: str = "fcfs",
    policy_obj=None,
    chunked: bool = True,
    threshold: int = 0,
    clock: FakeClock | None = None,
    max_wait_s: float = 30.0,
    num_cpu_blocks: int = 0,
    job_admission: bool = False,
    pins_yield_to_tier: bool = True,
    speculative: dict | None = None,
    max_loras: int = 0,
    disable_chunked_mm_input: bool = False,
    prefix_caching: bool = True,
) -> Scheduler:
    config = VllmConfig(
        lora_config=LoRAConfig(enable_lora=max_loras > 0, max_loras=max(max_loras, 1)),
        speculative_config=SpeculativeConfig(speculative),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold,
            disable_chunked_mm_input=disable_chunked_mm_input,
            policy=policy,
        ),
        policy_config=PolicyConfig(
            max_wait_s=max_wait_s,
            job_admission=job_admission,
            pins_yield_to_tier=pins_yield_to_tier,
        ),
    )
    clock = clock or FakeClock()
    has_kv_tier = num_cpu_blocks > 0  # (the engine core's rule)
    if policy_obj is None:
        policy_obj = create_policy(
            config, decode=lambda ids: "", clock=clock, has_kv_tier=has_kv_tier
        )
    else:  # a test's own policy object, as create_policy would build it for this engine
        policy_obj.has_tier = has_kv_tier
    return Scheduler(
        config, num_blocks, policy=policy_obj, clock=clock, num_cpu_blocks=num_cpu_blocks
    )


def fake_output(so: SchedulerOutput, sched: Scheduler, token: int = 7) -> ModelRunnerOutput:
    """Sample ``token`` for every request whose scheduled tokens reach its end."""
    sampled = {}
    for req_id in so.num_scheduled_tokens:
        req = sched.requests[req_id]
        sampled[req_id] = [token] if req.num_computed_tokens >= req.num_tokens else []
    return ModelRunnerOutput(req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled)


def step(sched: Scheduler, token: int = 7):
    so = sched.schedule()
    out = sched.update_from_output(so, fake_output(so, sched, token))
    sched.check_invariants()
    return so, out


def run_until_done(sched: Scheduler, max_steps: int = 500) -> int:
    for n in range(max_steps):
        if not sched.has_unfinished_requests():
            return n
        step(sched)
    raise AssertionError("requests did not finish")
