"""--async-scheduling: the next step is scheduled and launched before the last one's tokens
reach the host (they stay on the device, the scheduler counts them as placeholders).

On the CPU nothing overlaps (the forward runs on the calling thread), but the pipeline is
the one that runs on a GPU: every test compares an engine with it against one without it
on the embedded model (fp32), token for token, and checks that steps were deferred."""

from __future__ import annotations

import json

import pytest

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.engine import EngineCoreRequest, FinishReason
from vllm.v1.worker.model_runner import DeferredOutput

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3,",
    "Once upon a time, in a land far away, there lived a young girl who loved to",
    "Here is a list of the ten most popular programming languages in 2024:\n1.",
    "The quick brown fox",
]


def make_llm(async_scheduling: bool, **kw) -> LLM:
    # A pool of 15 usable blocks (240 tokens) for 6 requests growing to ~80 tokens each:
    # requests are preempted and recomputed; a step budget of 32 chunks the prompts.
    args = dict(
        num_gpu_blocks_override=16,
        max_num_batched_tokens=32,
        max_model_len=256,
        quantization="fp32",
        async_scheduling=async_scheduling,
    )
    return LLM(**{**args, **kw})


class Counts:
    """Wraps an LLM's runner and scheduler to count deferred steps and preemptions."""

    def __init__(self, llm: LLM) -> None:
        self.deferred = self.steps = self.preemptions = 0
        core = llm.engine_core
        runner, sched = core.model_runner, core.scheduler
        execute, preempt = runner.execute_model, sched._preempt

        def counted_execute(so, *args, **kwargs):
            out = execute(so, *args, **kwargs)
            self.steps += 1
            self.deferred += isinstance(out, DeferredOutput)
            return out

        def counted_preempt(*args):
            self.preemptions += 1
            return preempt(*args)

        runner.execute_model = counted_execute
        sched._preempt = counted_preempt


@pytest.fixture(scope="module")
def llms():
    pair = {mode: make_llm(mode) for mode in (False, True)}
    yield pair
    for llm in pair.values():
        llm.shutdown()


def run(llm: LLM, prompts, params):
    counts = Counts(llm)
    outs = llm.generate(prompts, params)
    core = llm.engine_core
    if core._in_flight is not None:
        # A step launched before its requests stopped (on a stop token): its tokens are
        # no one's, the next step drops them.
        assert core.has_unfinished_requests()
        out = core.step()
        assert not out.outputs and not out.errors
    sched = core.scheduler
    sched.check_invariants()
    assert sched.kv_cache_manager.usage == 0.0  # every block back
    assert not any(r.num_output_placeholders for r in sched.requests.values())
    assert llm.engine_core._in_flight is None
    return outs, counts


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_tokens_equal_under_preemption_and_chunked_prefill(llms):
    params = [greedy(30 + 12 * i) for i in range(len(PROMPTS))]
    sync, _ = run(llms[False], PROMPTS, params)
    ahead, counts = run(llms[True], PROMPTS, params)
    for a, b in zip(sync, ahead, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason == "length"
    assert counts.preemptions > 0  # the pool binds: placeholders were dropped and redone
    assert counts.deferred > counts.steps // 2  # most steps left their tokens on the device


def test_stop_token_ends_the_request_where_it_does_without(llms):
    probe, _ = run(llms[False], PROMPTS[:3], greedy(12))
    # Each request's 4th token stops it (max_tokens alone would end it at 12).
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[o.outputs[0].token_ids[3]])
        for o in probe
    ]
    sync, _ = run(llms[False], PROMPTS[:3], params)
    ahead, counts = run(llms[True], PROMPTS[:3], params)
    for a, b in zip(sync, ahead, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].token_ids) <= 4
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason == "stop"
    assert counts.deferred > 0


def test_seeded_random_rows_are_left_on_the_device_with_the_same_tokens(llms):
    # Random rows (temperature, top-k, top-p, min-p) are filtered and drawn on the device,
    # one uniform number from each row's generator: seeded, they give the tokens they give
    # without async scheduling, and their steps are deferred like greedy ones.
    filters = [{}, {"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {"top_k": 50, "top_p": 0.8}]
    params = [
        SamplingParams(temperature=0.7 + 0.1 * i, seed=11 + i, max_tokens=24, ignore_eos=True, **f)
        for i, f in enumerate(filters)
    ] + [greedy(24)]
    sync, _ = run(llms[False], PROMPTS, params)
    ahead, counts = run(llms[True], PROMPTS, params)
    for a, b in zip(sync, ahead, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert counts.deferred > counts.steps // 2


def test_penalties_and_logits_processors_stay_on_the_device_with_the_same_tokens(llms):
    # Penalties, min_tokens, logit_bias, bad words and allowed ids read a request's
    # output: a deferred step of such rows first takes the tokens of the step before it
    # (already ahead of its forward), then samples on the device. Same tokens as without
    # async scheduling, and the steps are still deferred.
    tok = llms[False].get_tokenizer()
    probe, _ = run(llms[False], PROMPTS[:1], greedy(3))
    first = probe[0].outputs[0].token_ids[0]  # what the first request says first, greedily
    params = [
        greedy(24, repetition_penalty=1.3, min_tokens=3, stop_token_ids=[first]),
        SamplingParams(temperature=0.9, seed=3, max_tokens=24, ignore_eos=True,
                       frequency_penalty=0.8, top_p=0.9),
        greedy(24, presence_penalty=1.5, logit_bias={tok.encode(" the")[0]: 4.0}),
        greedy(24, bad_words=[" and", " the"], repetition_penalty=1.1),
        SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True,
                       allowed_token_ids=list(range(100, 400))),
        greedy(24),
    ]  # fmt: skip
    sync, _ = run(llms[False], PROMPTS, params)
    ahead, counts = run(llms[True], PROMPTS, params)
    for a, b in zip(sync, ahead, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    # The penalties bit: without them the first request would stop at its first token.
    assert len(sync[0].outputs[0].token_ids) >= 3
    assert all(100 <= t < 400 for t in sync[4].outputs[0].token_ids)
    assert counts.deferred > counts.steps // 2


def assert_same_logprobs(a, b):
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        assert (y.token_id, y.rank) == (x.token_id, x.rank)
        assert y.logprob == pytest.approx(x.logprob, abs=1e-5)
        assert [t for t, _ in y.top] == [t for t, _ in x.top]
        assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-5)


def test_logprobs_are_computed_on_the_device_in_deferred_steps(llms):
    # Each sampled token's logprobs (rank, top n) ride the deferred copy to the host.
    params = [
        greedy(20, logprobs=3),
        SamplingParams(temperature=0.8, seed=9, max_tokens=20, ignore_eos=True, logprobs=0),
        greedy(20, logprobs=3, presence_penalty=0.7),
        SamplingParams(temperature=1.0, seed=4, max_tokens=20, ignore_eos=True, top_k=30),
    ]
    sync, _ = run(llms[False], PROMPTS[:4], params)
    ahead, counts = run(llms[True], PROMPTS[:4], params)
    for a, b in zip(sync, ahead, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert (a.outputs[0].logprobs is None) == (b.outputs[0].logprobs is None)
        if a.outputs[0].logprobs is not None:
            assert_same_logprobs(a, b)
    assert len(ahead[0].outputs[0].logprobs[0].top) == 3
    assert counts.deferred > counts.steps // 2


def test_grammar_rows_stay_on_the_device_and_their_text_follows_the_grammar(llms):
    # A grammar's mask for the next token is built on the host from the matcher after the
    # last token: a deferred step with grammar rows first takes the step before (its
    # tokens advance the matchers), then masks, samples and stays on the device.
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    params = [
        SamplingParams(temperature=0.0, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.8, seed=2, max_tokens=40,
                       structured_outputs=StructuredOutputsParams(json=schema)),
        SamplingParams(temperature=0.0, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        greedy(30),
    ]  # fmt: skip
    prompts = [
        "Weather in Paris for 3 days as JSON:",
        "Rome, 2 days:",
        "Is it raining?",
        PROMPTS[0],
    ]
    sync, _ = run(llms[False], prompts, params)
    ahead, counts = run(llms[True], prompts, params)
    for a, b in zip(sync, ahead, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    for out in ahead[:2]:
        if out.outputs[0].finish_reason == "stop":  # a complete object
            assert set(json.loads(out.outputs[0].text)) == {"city", "days"}
    assert ahead[2].outputs[0].text in ("yes", "no")
    assert counts.deferred > counts.steps // 2


def test_sampled_rows_logprobs_and_prompt_logprobs_beside_greedy_ones(llms):
    # Prompt logprobs are computed on the device too (from the prompt's own tokens) and
    # ride the deferred copy to the host with the sampled tokens.
    params = [
        greedy(20),
        SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, top_p=0.9),
        greedy(20, logprobs=2),
        greedy(6, prompt_logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.3),
        greedy(30),
    ]
    sync, _ = run(llms[False], PROMPTS, params)
    ahead, counts = run(llms[True], PROMPTS, params)
    for a, b in zip(sync, ahead, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        if a.outputs[0].logprobs is not None:
            assert_same_logprobs(a, b)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        if a.prompt_logprobs is not None:
            assert len(b.prompt_logprobs) == len(a.prompt_logprobs) > 1
            for x, y in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True):
                if x is None:  # the first prompt token has none
                    assert y is None
                    continue
                assert (y.token_id, y.rank) == (x.token_id, x.rank)
                assert y.logprob == pytest.approx(x.logprob, abs=1e-5)
                assert [t for t, _ in y.top] == [t for t, _ in x.top]
    assert counts.deferred > counts.steps // 2


def core_request(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=greedy(max_tokens),
        eos_token_id=None,
    )


def drive(core, outputs: dict[str, list[int]], finished: dict[str, str], limit: int = 500):
    for _ in range(limit):
        if not core.has_unfinished_requests():
            return
        out = core.step()
        assert not out.errors
        for o in out.outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
    raise AssertionError("the engine did not finish")


def test_abort_and_an_id_reused_while_a_step_is_on_the_device(llms):
    tok = llms[False].get_tokenizer()
    a, b = (tok.encode(p) for p in PROMPTS[:2])
    expect = {}
    for rid, prompt in (("a", a), ("b", b)):
        outs = llms[False].generate({"prompt_token_ids": prompt}, greedy(24))
        expect[rid] = outs[0].outputs[0].token_ids
    core = llms[True].engine_core
    core.add_request(core_request("a", a, 24))
    core.add_request(core_request("b", b, 24))
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    while len(outputs.get("a", [])) < 3:  # both decode; a step is on the device
        for o in core.step().outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert core._in_flight is not None
    core.abort_requests(["a"])
    # The same id again at once: the step on the device still carries the old "a"'s row,
    # whose token must not reach the new request.
    core.add_request(core_request("a", b, 24))
    outputs["a"] = []
    drive(core, outputs, finished)
    assert outputs["b"] == expect["b"]
    assert outputs["a"] == expect["b"]  # the new "a" has b's prompt
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    core.scheduler.check_invariants()
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_a_row_that_fails_on_the_device_fails_its_request_alone(llms):
    # "a" has a repetition penalty that turns its logits into inf (past validation): its
    # row fails on the device, in a deferred step, and the step scheduled ahead embeds
    # whatever token the device drew for it (an id in range). "a" fails with the
    # request's own error; "b" in the same steps is untouched.
    tok = llms[False].get_tokenizer()
    a, b = (tok.encode(p) for p in PROMPTS[:2])
    expect = llms[False].generate({"prompt_token_ids": b}, greedy(16))[0].outputs[0].token_ids
    core = llms[True].engine_core
    bad = SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)
    object.__setattr__(bad, "repetition_penalty", 1e-300)
    core.add_request(
        EngineCoreRequest(request_id="a", prompt_token_ids=a, sampling_params=bad,
                          eos_token_id=None)
    )  # fmt: skip
    core.add_request(core_request("b", b, 16))
    counts = Counts(llms[True])
    outputs: dict[str, list[int]] = {}
    errors = []
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        out = core.step()
        errors += out.errors
        for o in out.outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not core.has_unfinished_requests()
    assert [e.request_id for e in errors] == ["a"]
    assert "sampling parameters" in errors[0].message and not errors[0].internal
    assert outputs["b"] == expect and not outputs.get("a")
    assert counts.deferred > 0
    core.scheduler.check_invariants()
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_a_row_that_raises_on_the_device_fails_alone_on_the_host(llms, caplog):
    # "a"'s generator is broken after its first step: sampling its step on the device
    # raises, the step is sampled on the host instead, row by row, and only "a" fails.
    tok = llms[False].get_tokenizer()
    a, b = (tok.encode(p) for p in PROMPTS[:2])
    expect = llms[False].generate({"prompt_token_ids": b}, greedy(12))[0].outputs[0].token_ids
    core = llms[True].engine_core
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    core.add_request(
        EngineCoreRequest(request_id="a", prompt_token_ids=a, sampling_params=seeded,
                          eos_token_id=None)
    )  # fmt: skip
    core.add_request(core_request("b", b, 12))
    outputs: dict[str, list[int]] = {}
    errors = []
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        state = core.model_runner.requests.get("a")
        if state is not None and state.generator is not None and outputs.get("a"):
            state.generator = "not a generator"
        out = core.step()
        errors += out.errors
        for o in out.outputs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not core.has_unfinished_requests()
    assert [e.request_id for e in errors] == ["a"] and errors[0].internal
    assert outputs["b"] == expect
    assert "sampling on the device failed" in caplog.text
    core.scheduler.check_invariants()
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_continuum_pins_equal_without_async_scheduling():
    # Two turns of one job: the first's blocks are pinned, the second hits them.
    turns = [PROMPTS[3], PROMPTS[3] + " run and"]
    results = {}
    for mode in (False, True):
        llm = make_llm(mode, scheduling_policy="continuum", kv_offloading_size=0)
        try:
            counts = Counts(llm)
            outs = []
            for i, prompt in enumerate(turns):
                extra = {"job_id": "job", "is_last_step": i == len(turns) - 1}
                params = greedy(10, extra_args=extra)
                outs.append(llm.generate(prompt, params)[0])
            results[mode] = outs
            sched = llm.engine_core.scheduler
            sched.check_invariants()
            assert sched.kv_cache_manager.usage == 0.0  # the last step's blocks are freed
        finally:
            llm.shutdown()
        assert counts.deferred > 0 or not mode
    for a, b in zip(results[False], results[True], strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.num_cached_tokens == a.num_cached_tokens
    assert results[True][1].num_cached_tokens > 0  # the pin was hit


def test_async_scheduling_refuses_speculative_decoding():
    args = EngineArgs(
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    with pytest.raises(ValueError, match="--async-scheduling"):
        args.create_engine_config()


def test_the_flag_reaches_the_scheduler_config():
    import argparse

    parsed = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(["--async-scheduling"])
    config = EngineArgs.from_cli_args(parsed).create_engine_config()
    assert config.scheduler_config.async_scheduling
    assert not EngineArgs().create_engine_config().scheduler_config.async_scheduling
