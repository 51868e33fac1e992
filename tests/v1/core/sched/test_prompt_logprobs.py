"""Prompt logprobs in the scheduler: no prefix-cache reads while they are being computed,
chunks accumulated across steps, sent once with the first token, no duplicate after a
recompute (issue 16).

Block size 4. The fake runner's entry for prompt position p has logprob -p, so a list of
entries names the positions it covers.
"""

from __future__ import annotations

import pytest

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput, PromptLogprobs, TokenLogprobs

from ..conftest import make_request
from .helpers import make_scheduler, run_until_done

PROMPT = list(range(100, 110))  # 10 tokens: two full blocks + 2


def entry(prompt: list[int], position: int) -> TokenLogprobs:
    return TokenLogprobs(prompt[position], -float(position), 1)


def runner_output(so: SchedulerOutput, sched: Scheduler) -> ModelRunnerOutput:
    """A token for requests that reached their end; prompt logprobs of each chunk."""
    sampled, prompt_lps = {}, {}
    for req_id, n in so.num_scheduled_tokens.items():
        req = sched.requests[req_id]
        sampled[req_id] = [7] if req.num_computed_tokens >= req.num_tokens else []
        start = req.num_computed_tokens - n  # counted as computed at schedule time
        end = min(req.num_computed_tokens, req.num_prompt_tokens - 1)
        if req.sampling_params.prompt_logprobs is not None and end > start:
            entries = [entry(req.prompt_token_ids, p + 1) for p in range(start, end)]
            prompt_lps[req_id] = PromptLogprobs(start + 1, entries)
    return ModelRunnerOutput(list(so.num_scheduled_tokens), sampled, prompt_logprobs=prompt_lps)


def step(sched: Scheduler):
    so = sched.schedule()
    out = sched.update_from_output(so, runner_output(so, sched))
    sched.check_invariants()
    return so, out


def test_prompt_logprobs_skip_the_prefix_cache_but_others_still_hit():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request(PROMPT))
    run_until_done(sched)  # caches PROMPT's two full blocks
    wants = make_request(PROMPT, prompt_logprobs=1)
    sched.add_request(wants)
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0  # computes every position
    assert wants.num_cached_tokens == 0
    other = make_request(PROMPT)
    sched.add_request(other)
    so, _ = step(sched)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8  # the cache still serves


def test_chunks_accumulate_and_go_out_once_with_the_first_token():
    sched = make_scheduler(budget=4)  # chunks of 4: positions 0-3, 4-7, 8-9
    sched.add_request(make_request(PROMPT, max_tokens=3, prompt_logprobs=2))
    sent = []
    for _ in range(3):
        _, out = step(sched)
        sent.append([o.new_prompt_logprobs for o in out.outputs])
    assert sent[:2] == [[], []]  # partial prefill chunks: no output yet
    (first,) = sent[2]
    assert [-lp.logprob for lp in first] == list(range(1, 10))  # positions 1..9, in order
    assert [lp.token_id for lp in first] == PROMPT[1:]
    _, out = step(sched)
    assert out.outputs[0].new_prompt_logprobs is None  # decode steps carry none
    run_until_done(sched)


def test_a_recompute_adds_no_duplicate_and_a_gap_is_an_error():
    request = make_request(PROMPT, prompt_logprobs=0)
    chunk = [entry(PROMPT, p) for p in range(1, 5)]
    request.add_prompt_logprobs(PromptLogprobs(1, chunk))  # positions 1-4
    # Preempted mid-prefill, recomputed from 0: positions 1-8 come again.
    request.add_prompt_logprobs(PromptLogprobs(1, [entry(PROMPT, p) for p in range(1, 9)]))
    assert request.num_prompt_logprobs == 8
    assert [-lp.logprob for lp in request.take_prompt_logprobs()] == list(range(1, 9))
    assert request.take_prompt_logprobs() is None
    assert request.skip_reading_prefix_cache  # position 9 still to compute
    request.add_prompt_logprobs(PromptLogprobs(9, [entry(PROMPT, 9)]))
    assert not request.skip_reading_prefix_cache  # all sent: a recompute may hit the cache
    with pytest.raises(ValueError, match="prefix hit"):
        make_request(PROMPT, prompt_logprobs=0).add_prompt_logprobs(
            PromptLogprobs(5, [entry(PROMPT, 5)])
        )
