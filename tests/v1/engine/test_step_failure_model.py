"""Faults inside a step of the real model runner fail their requests only (issue 16).

The offline ``LLM`` on the embedded model (in-process ``EngineCore``), with faults
injected by monkeypatching: NaN logits for one request's row (the sampler fails that row
alone) and an exception from the model's forward pass whenever a marked request is in
the batch (the whole step fails). The other requests' tokens are compared with a run
without faults; the pool, the prefix cache and the runner's per-request state must hold
nothing of the failed requests.
"""

from __future__ import annotations

import pytest

import vllm.v1.worker.model_runner as model_runner_module
from vllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

MARK = 12345  # a token id the good prompts do not contain
BAD = [MARK, 1, 2, 3, 4, 5]
GOOD = [
    "Here is a list of the ten most popular programming languages in 2024, with a "
    "short explanation of what each one is used for, who created it, and why so many "
    "developers like it:\n1.",
    "The capital of France is",
    "1, 2, 3,",
]


@pytest.fixture(scope="module")
def llm():
    # Budget 32 tokens per step: BAD and the first 26 tokens of GOOD[0] share step 1. fp32:
    # tokens are compared across batches of other compositions (the exactness reference).
    return LLM(
        num_gpu_blocks_override=64,
        max_num_batched_tokens=32,
        max_model_len=512,
        quantization="fp32",
    )


def params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True)
    return [greedy, seeded, greedy]


@pytest.fixture(scope="module")
def expected(llm) -> list[list[int]]:
    for prompt in GOOD:
        assert MARK not in llm.get_tokenizer()(prompt).input_ids
    assert len(llm.get_tokenizer()(GOOD[0]).input_ids) > 40
    return [o.outputs[0].token_ids for o in llm.generate(GOOD, params())]


def assert_nothing_left(llm, failed_ids: list[str]) -> None:
    core = llm.engine_core
    core.scheduler.check_invariants()
    assert core.scheduler.kv_cache_manager.usage == 0.0
    llm.generate("1,", SamplingParams(temperature=0.0, max_tokens=1))  # delivers finished ids
    runner = core.model_runner
    for req_id in failed_ids:
        assert req_id not in runner.requests and req_id not in runner._paused_generators


def test_nan_logits_fail_one_request_and_its_batch_goes_on(llm, expected, monkeypatch):
    sample = model_runner_module.sample

    def nan_for_marked(logits, rows, *args):
        for i, row in enumerate(rows):
            if row.prompt_token_ids[0] == MARK:
                logits[i, 0] = float("nan")
        return sample(logits, rows, *args)

    monkeypatch.setattr(model_runner_module, "sample", nan_for_marked)
    first_id = llm._request_counter
    outs = llm.generate([BAD, *GOOD], [params()[0], *params()])
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    # Sampled in the same steps as the failed row, seeded or not: unchanged.
    assert [o.outputs[0].token_ids for o in outs[1:]] == expected
    assert_nothing_left(llm, [str(first_id)])


def test_a_forward_pass_that_raises_fails_its_step_only(llm, expected, monkeypatch):
    model = llm.engine_core.model_runner.model
    forward = model.forward

    def faulty(input_ids, *args, **kwargs):
        if bool((input_ids == MARK).any()):
            raise RuntimeError("injected fault")
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", faulty)
    assert llm.reset_prefix_cache()  # GOOD[0] is computed, not found, in step 1
    first_id = llm._request_counter
    outs = llm.generate([BAD, *GOOD], [params()[0], *params()])
    reasons = [o.outputs[0].finish_reason for o in outs]
    # Step 1 held BAD and a chunk of GOOD[0]: both fail; the others were not in it.
    assert reasons[:2] == ["error", "error"]
    assert [o.outputs[0].token_ids for o in outs[2:]] == expected[1:]
    assert_nothing_left(llm, [str(first_id), str(first_id + 1)])
    monkeypatch.undo()
    # GOOD[0]'s first block was hashed for the failed step: its KV must not be served.
    again = llm.generate(GOOD, params())
    assert [o.outputs[0].token_ids for o in again] == expected
    assert again[0].num_cached_tokens == 0
