"""Rejection sampling of n-gram drafts keeps plain sampling's distribution, position by
position (a statistical check with a seeded generator: 20,000 draws a case)."""

from __future__ import annotations

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.rejection_sampler import target_probs, verify_sampled

TRIALS = 20_000
TOLERANCE = 0.015  # about 5 standard errors of a frequency near 0.5 at 20,000 draws


def frequencies(values: list[int], size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(values, dtype=torch.long), minlength=size).double() / max(
        len(values), 1
    )


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
)
def test_each_position_has_the_target_distribution(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor(
        [[2.0, 1.5, 0.5, 0.0, -1.0], [0.0, 1.0, 2.0, 0.5, 0.0], [1.0, 1.0, 1.0, 3.0, 0.0]]
    )
    drafts = [1, 2]  # plausible, not certain: kept sometimes
    p = [target_probs(row, params).double() for row in logits]
    first, second, third = [], [], []
    for _ in range(TRIALS):
        tokens = verify_sampled(logits, drafts, params, gen)
        first.append(tokens[0])
        if tokens[0] == drafts[0]:
            second.append(tokens[1])
            if tokens[1] == drafts[1]:
                third.append(tokens[2])
    assert torch.allclose(frequencies(first, 5), p[0], atol=TOLERANCE)
    # Given the first draft kept, the next token has the second row's distribution.
    assert torch.allclose(frequencies(second, 5), p[1], atol=2 * TOLERANCE)
    if len(third) > 2000:
        assert torch.allclose(frequencies(third, 5), p[2], atol=3 * TOLERANCE)


def test_a_certain_draft_is_always_kept_and_an_impossible_one_never():
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0, top_k=1)  # one token has all the mass
    logits = torch.tensor([[0.0, 5.0, 1.0], [4.0, 0.0, 1.0]])
    assert verify_sampled(logits, [1], params, gen) == [1, 0]
    assert verify_sampled(logits, [2], params, gen) == [1]  # rejected: the other token


def test_non_finite_logits_fail_the_request():
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[0.0, float("nan")], [0.0, 1.0]])
    assert verify_sampled(logits, [1], params, None) is None
