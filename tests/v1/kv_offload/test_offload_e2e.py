"""The CPU KV tier on the embedded model: a tiny KV cache plus a tier gives the same greedy
tokens as a cache that never evicts, and the tokens came back through real copies."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the Roman Empire, from the founding of the city on the seven hills to "
    "the fall of Constantinople in 1453, is long, violent and full of surprises, and "
    "historians still argue about its causes. Its first emperor was",
    "Here is a list of the ten most popular programming languages in 2024, with a short "
    "explanation of what each one is used for, who uses it, and why developers like it "
    "so much more than the alternatives:\n1.",
    "Once upon a time, in a land far away beyond the mountains and the sea, there lived a "
    "young girl who loved to read old books about dragons, castles and brave knights "
    "late into the night. One day she",
]
# Each prompt again after the others evicted it from the 7-block KV cache.
ORDER = [0, 1, 2, 0, 1, 2]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tiny_pool_with_tier_matches_a_pool_that_never_evicts(async_scheduling):
    # fp32 both: tokens are compared across two batch histories (the exactness reference).
    # With --async-scheduling the tier's copies run while a step may still be on the
    # device: the same tokens, the same hits.
    big = LLM(num_gpu_blocks_override=64, max_model_len=512, quantization="fp32")
    expected = [big.generate(PROMPTS[i], greedy())[0].outputs[0].token_ids for i in ORDER]
    del big
    # 7 usable blocks of 16 tokens: one ~50-token prompt and its output at a time.
    llm = LLM(
        num_gpu_blocks_override=8,
        max_model_len=512,
        kv_offloading_size=0.02,
        quantization="fp32",
        async_scheduling=async_scheduling,
    )
    runner = llm.engine_core.model_runner
    loads = []
    transfer = runner.transfer_kv

    def counting_transfer(plan):
        transfer(plan)
        loads.extend(plan.loads)
        # The copy is a copy: each loaded block equals its tier block, in separate memory.
        for cpu, gpu in plan.loads:
            for tier, cache in zip(runner.kv_offload.cpu_caches, runner.kv_caches, strict=True):
                assert torch.equal(tier[:, cpu], cache[:, gpu])

    runner.transfer_kv = counting_transfer
    got = [llm.generate(PROMPTS[i], greedy())[0] for i in ORDER]
    assert [g.outputs[0].token_ids for g in got] == expected
    # The second round found every prompt's full blocks in the tier, not the pool.
    for out in got[3:]:
        assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // 16 * 16 >= 32
    assert len(loads) >= 6
    tier, cache = runner.kv_offload.cpu_caches[0], runner.kv_caches[0]
    assert tier.untyped_storage().data_ptr() != cache.untyped_storage().data_ptr()
    sched = llm.engine_core.scheduler
    sched.check_invariants()
    assert sched.kv_cache_manager.usage == 0.0
