"""``merge_delta``: two DELTA outputs of one request as one (a stream's slow reader)."""

from __future__ import annotations

import copy

from vllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, merge_delta
from vllm.v1.outputs import TokenLogprobs


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token_id=token, logprob=-0.5, rank=1)


def out(outputs, finished=False, cached=0, prompt_logprobs=None) -> RequestOutput:
    return RequestOutput(
        "r", None, [1, 2], outputs, finished, cached, RequestMetrics(0.0), prompt_logprobs
    )


def test_sequences_are_appended_and_the_rest_is_the_later_outputs():
    first = out(
        [
            CompletionOutput(0, "Hel", [5], -0.5, [lp(5)]),
            CompletionOutput(2, "A", [9], -0.5, [lp(9)]),
        ],
        prompt_logprobs=[None, lp(2)],
    )
    then = out(
        [
            CompletionOutput(1, "x", [3], -0.1, [lp(3)]),  # n > 1: a sequence new here
            CompletionOutput(0, "lo", [6, 7], -1.5, [lp(6), lp(7)], "stop", "lo"),
        ],
        finished=True,
        cached=16,
    )
    before = copy.deepcopy((first, then))
    merged = merge_delta(first, then)
    assert [c.index for c in merged.outputs] == [0, 1, 2]
    zero = merged.outputs[0]
    assert (zero.text, zero.token_ids, zero.cumulative_logprob) == ("Hello", [5, 6, 7], -1.5)
    assert [e.token_id for e in zero.logprobs] == [5, 6, 7]
    assert (zero.finish_reason, zero.stop_reason) == ("stop", "lo")
    assert merged.outputs[1].text == "x" and merged.outputs[2].token_ids == [9]
    assert merged.finished and merged.num_cached_tokens == 16
    assert merged.prompt_logprobs == [None, lp(2)]  # sent once, with the first
    assert (first, then) == before  # the stats loggers still read both as they were


def test_without_logprobs_the_merge_has_none():
    merged = merge_delta(out([CompletionOutput(0, "a", [1])]), out([CompletionOutput(0, "b", [2])]))
    assert merged.outputs[0].logprobs is None and merged.outputs[0].text == "ab"
