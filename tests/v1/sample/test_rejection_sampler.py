"""Rejection sampling of n-gram drafts keeps plain sampling's distribution, position by
position (a statistical check with a seeded generator: 20,000 draws a case)."""

from __future__ import annotations

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.rejection_sampler import (
    SampledDrafts,
    target_probs,
    verify_sampled,
    verify_sampled_batch,
)

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


# -- drafts drawn from the drafter's own distribution q --------------------------------
LOGITS = torch.tensor(
    [[2.0, 1.5, 0.5, 0.0, -1.0], [0.0, 1.0, 2.0, 0.5, 0.0], [1.0, 1.0, 1.0, 3.0, 0.0]]
)
# The drafter's q for the two drafted positions: unlike p (too sure of token 1 first,
# of token 0 next; token 4 it never proposes at the first position).
DRAFT_Q = torch.tensor([[0.1, 0.6, 0.1, 0.2, 0.0], [0.5, 0.1, 0.2, 0.1, 0.1]])


def _broken_residual(logits, drafts, params, gen, q):
    """The ratio test, but the point mass's residual (p without d) after a rejection."""
    for i, d in enumerate(drafts):
        p = target_probs(logits[i], params)
        if torch.rand((), dtype=torch.float64, generator=gen).item() * q[i, d] < p[d]:
            continue
        p = p.clone()
        p[d] = 0.0
        return [*drafts[:i], int(torch.multinomial(p, 1, generator=gen))]
    p = target_probs(logits[len(drafts)], params)
    return [*drafts, int(torch.multinomial(p, 1, generator=gen))]


def _broken_ratio(logits, drafts, params, gen, q):
    """The point mass's test (keep d with probability p(d)), with the residual p - q."""
    for i, d in enumerate(drafts):
        p = target_probs(logits[i], params)
        if torch.rand((), dtype=torch.float64, generator=gen).item() < p[d]:
            continue
        residual = (p - q[i]).clamp(min=0.0)
        return [*drafts[:i], int(torch.multinomial(residual, 1, generator=gen))]
    p = target_probs(logits[len(drafts)], params)
    return [*drafts, int(torch.multinomial(p, 1, generator=gen))]


def _q_mismatch(verify, params, seed=0) -> float:
    """The largest gap, over the three positions and five tokens, between the frequencies
    of ``verify``'s tokens (drafts drawn from DRAFT_Q) and the target's distribution; each
    later position is conditioned on the drafts before it kept, and its gap scaled by
    sqrt(share of draws reaching it) so one tolerance fits all three."""
    gen = torch.Generator().manual_seed(seed)
    positions: list[list[int]] = [[], [], []]
    for _ in range(TRIALS):
        drafts = [int(torch.multinomial(row, 1, generator=gen)) for row in DRAFT_Q]
        tokens = verify(LOGITS, drafts, params, gen, DRAFT_Q)
        for i, token in enumerate(tokens):
            positions[i].append(token)
            if i < len(drafts) and token != drafts[i]:
                break
    gaps = []
    for i, values in enumerate(positions):
        if len(values) < 1000:
            continue
        p = target_probs(LOGITS[i], params).double()
        share = len(values) / TRIALS
        gaps.append((frequencies(values, 5) - p).abs().max().item() * share**0.5)
    return max(gaps)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)]
)
def test_drafts_drawn_from_q_leave_each_position_the_target_distribution(params):
    assert _q_mismatch(verify_sampled, params) < TOLERANCE
    # The check has the power to see a wrong residual or a wrong acceptance ratio.
    assert _q_mismatch(_broken_residual, params) > 2 * TOLERANCE
    assert _q_mismatch(_broken_ratio, params) > 2 * TOLERANCE


def test_q_equal_to_p_keeps_every_draft_and_the_ratio_test_keeps_more():
    params = SamplingParams(temperature=0.8, top_k=4)
    p = torch.stack([target_probs(row, params) for row in LOGITS[:2]])
    gen = torch.Generator().manual_seed(3)
    for _ in range(2000):
        drafts = [int(torch.multinomial(row, 1, generator=gen)) for row in p]
        tokens = verify_sampled(LOGITS, drafts, params, gen, p)
        assert tokens[:2] == drafts and len(tokens) == 3
    # The same q-drawn drafts, checked as point masses (exact too), keep far fewer.
    kept = 0
    for _ in range(2000):
        drafts = [int(torch.multinomial(row, 1, generator=gen)) for row in p]
        kept += len(verify_sampled(LOGITS, drafts, params, gen)) - 1
    assert kept < 0.6 * 2 * 2000


def test_a_draft_q_could_not_have_drawn_is_rejected():
    params = SamplingParams(temperature=1.0)
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [0.2] * 5])
    gen = torch.Generator().manual_seed(4)
    for _ in range(200):  # q(0) = 0: draft 0 never kept; the residual p - q lacks token 1
        tokens = verify_sampled(LOGITS, [0, 1], params, gen, q)
        assert len(tokens) == 1 and tokens[0] != 1


# -- a step's sampled requests, verified together ---------------------------------------
def _mixed_requests(num: int, seed: int = 0) -> list[SampledDrafts]:
    """Requests of different filters, 0-2 drafts, q or point masses, some with a row
    that is not finite; each with its own generator seeded by its index."""
    rng = torch.Generator().manual_seed(seed)
    kinds = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.2),
    ]
    reqs = []
    for i in range(num):
        n = int(torch.randint(0, 3, (), generator=rng))
        logits = LOGITS[: n + 1].clone()
        if i % 7 == 3:
            logits[int(torch.randint(0, n + 1, (), generator=rng)), 2] = float("nan")
        drafts = [int(torch.randint(0, 5, (), generator=rng)) for _ in range(n)]
        q = DRAFT_Q[:n] if n and i % 2 else None
        gen = torch.Generator().manual_seed(i)
        reqs.append(SampledDrafts(logits, drafts, kinds[i % len(kinds)], gen, q))
    return reqs


def test_all_at_once_gives_each_request_the_tokens_it_gets_alone():
    # A request's random numbers are its own generator's, drawn in the same order either
    # way: the batch on the device (a GPU's way) equals the row-by-row check (a CPU's).
    together = verify_sampled_batch(_mixed_requests(60), together=True)
    alone = verify_sampled_batch(_mixed_requests(60), together=False)
    assert together == alone
    # Last, a request whose q is p: every draft kept (its q rows end the stack).
    params = SamplingParams(temperature=0.8, top_k=4)
    p = torch.stack([target_probs(row, params) for row in LOGITS[:2]])
    for together_ in (True, False):
        reqs = _mixed_requests(5) + [SampledDrafts(LOGITS, [1, 2], params, None, p)]
        assert verify_sampled_batch(reqs, together=together_)[-1][:2] == [1, 2]
    assert any(t is None for t in together)  # a row it needed was not finite
    assert any(t is not None and len(t) > 1 for t in together)  # drafts kept
    assert verify_sampled_batch([]) == []


@pytest.mark.parametrize("together", [True, False], ids=["together", "alone"])
def test_a_batch_leaves_each_position_the_target_distribution(together):
    # One batch of TRIALS requests, half with q-drawn drafts, half with the same drafts as
    # point masses, all on one generator: each position has the target's distribution.
    params = SamplingParams(temperature=0.8, top_p=0.9)
    gen = torch.Generator().manual_seed(5)
    reqs = []
    for i in range(TRIALS):
        drafts = [int(torch.multinomial(row, 1, generator=gen)) for row in DRAFT_Q]
        reqs.append(SampledDrafts(LOGITS, drafts, params, gen, DRAFT_Q if i % 2 else None))
    out = verify_sampled_batch(reqs, together=together)
    for parity in (0, 1):
        positions: list[list[int]] = [[], []]
        for r, tokens in zip(reqs[parity::2], out[parity::2], strict=True):
            positions[0].append(tokens[0])
            if tokens[0] == r.drafts[0]:
                positions[1].append(tokens[1])
        for i, values in enumerate(positions):
            p = target_probs(LOGITS[i], params).double()
            share = (len(values) / (TRIALS / 2)) ** 0.5
            gap = (frequencies(values, 5) - p).abs().max().item() * share
            assert gap < 1.5 * TOLERANCE, (parity, i, gap)
