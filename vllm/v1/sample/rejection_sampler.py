"""Checking draft tokens of a sampled request (speculative decoding), exactly.

Speculative sampling (Leviathan et al., 2023; vLLM's rejection sampler): draft d, drawn
from the drafter's distribution q, is kept with probability min(1, p(d) / q(d)), p being
the target's distribution after the request's temperature, top-k, top-p and min-p; at the
first draft not kept, the next token is drawn from the normalised residual max(0, p - q);
after the last kept draft, from the next row's p. Each token then has exactly the
distribution plain sampling would give it, and with q = p every draft is kept.

A drafter that gives no q (n-gram lookup; a draft model's greedy proposals) is treated as
a point mass on d: keep d with probability p(d), else draw from p without d. That rule is
exact for any draft the verifier's random numbers do not influence, however it was
chosen: P(x) = P(d = x) p(x) + sum over d != x of P(d) (1 - p(d)) p(x) / (1 - p(d)) = p(x).
It keeps fewer drafts than the ratio test when the drafts really were drawn from a q.
The random numbers come from the request's generator (seeded requests stay
reproducible, though not token-for-token equal to plain decoding).

``verify_sampled_batch`` checks a step's sampled requests in one of two ways that give
the same tokens (each request's random numbers drawn alike: a uniform number per draft,
then one for the drawn token). On a GPU, all at once on the device with one read to
the host (request by request took about four reads a draft, each a wait for the device);
a point mass is then the ratio test with q = one-hot(d): q(d) = 1 keeps d with
probability p(d), and max(0, p - q) is p without d. On a CPU, request by request, each
row filtered only when reached (a 128k-token row's filters cost more than the reads
they would save: measured in ``benchmarks/benchmark_sampler.py --rejection-ab``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from vllm.sampling_params import SamplingParams
from vllm.utils.device import to_device
from vllm.v1.sample.sampler import (
    SamplingRow,
    draw,
    filter_logits,
    filter_rows_on_device,
    inverse_cdf,
)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """A row's sampling distribution (temperature, then top-k / top-p / min-p), or None
    when its logits are not finite."""
    filtered = filter_logits(logits, params)
    if not torch.isfinite(filtered.amax()):
        return None
    return filtered.softmax(-1)


class SampledDrafts(NamedTuple):
    """One sampled request's drafts to verify."""

    logits: torch.Tensor  # (len(drafts) + 1, vocab): row i after the first i drafts
    drafts: Sequence[int]
    params: SamplingParams
    generator: torch.Generator | None
    draft_probs: torch.Tensor | None = None  # (len(drafts), vocab): q; None: point masses


def verify_sampled(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int] | None:
    """The tokens of one request's step (``SampledDrafts``'s fields); None when a row
    needed is not finite."""
    return verify_sampled_batch([SampledDrafts(logits, drafts, params, generator, draft_probs)])[0]


def _verify_one(r: SampledDrafts) -> list[int] | None:
    """One request, row by row, each row filtered only when reached."""
    device = r.logits.device
    uniforms = torch.rand(len(r.drafts), dtype=torch.float64, generator=r.generator, device=device)
    for i, draft in enumerate(r.drafts):
        p = target_probs(r.logits[i], r.params)
        if p is None:
            return None
        q = None if r.draft_probs is None else r.draft_probs[i].to(p.device, p.dtype)
        q_draft = 1.0 if q is None else q[draft].item()
        # u < p(d) / q(d), without dividing; a q(d) of 0 (q cannot have drawn d) rejects.
        if q_draft > 0.0 and uniforms[i].item() * q_draft < p[draft].item():
            continue  # kept
        if q is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - q).clamp_(min=0.0)
            if not residual.sum().item() > 0.0:  # p == q up to rounding: rejection had
                residual = p  # probability ~0; p is then the residual's limit
        return [*r.drafts[:i], draw(residual, r.generator)]
    p = target_probs(r.logits[len(r.drafts)], r.params)
    return None if p is None else [*r.drafts, draw(p, r.generator)]


def verify_sampled_batch(
    reqs: Sequence[SampledDrafts], together: bool | None = None
) -> list[list[int] | None]:
    """Each request's tokens (its kept drafts, then one drawn token), or None when one of
    the rows it needed (those up to its first rejection) is not finite. Every request's
    random numbers come from its generator: a uniform number per draft, then one for the
    drawn token. ``together``: all requests at once, one read from the device (None: off
    a CPU); else request by request."""
    if not reqs:
        return []
    device = reqs[0].logits.device
    if together is None:
        together = device.type != "cpu"
    if not together:
        return [_verify_one(r) for r in reqs]
    logits = torch.cat([r.logits for r in reqs]) if len(reqs) > 1 else reqs[0].logits
    counts = [len(r.drafts) for r in reqs]
    first_draft = list(itertools.accumulate(counts, initial=0))  # in the flat draft list
    starts = [f + i for i, f in enumerate(first_draft[:-1])]  # each request's first row
    rows = [SamplingRow(r.params, r.generator, (), []) for r in reqs]
    x = filter_rows_on_device(
        logits, [row for row, n in zip(rows, counts, strict=True) for _ in range(n + 1)]
    )
    finite = torch.isfinite(x.amax(-1))
    p = x.softmax(-1)
    most = max(counts)
    starts_t = to_device(starts, torch.long, device)
    if not most:
        target, kept = p[starts_t], torch.zeros(len(reqs), dtype=torch.long, device=device)
    else:
        drafts = to_device([d for r in reqs for d in r.drafts], torch.long, device)
        draft_rows = [s + j for s, n in zip(starts, counts, strict=True) for j in range(n)]
        p_d = p[to_device(draft_rows, torch.long, device), drafts].double()
        # The requests with a q: their rows stacked; the others' drafts are point masses.
        with_q = [i for i, r in enumerate(reqs) if r.drafts and r.draft_probs is not None]
        q_d = torch.ones_like(p_d)
        if with_q:
            q = torch.cat([reqs[i].draft_probs[: counts[i]].to(device, p.dtype) for i in with_q])
            flat = [first_draft[i] + j for i in with_q for j in range(counts[i])]
            flat_t = to_device(flat, torch.long, device)
            q_d[flat_t] = q.gather(1, drafts[flat_t, None])[:, 0].double()
        uniform = torch.cat(
            [
                torch.rand(len(r.drafts), dtype=torch.float64, generator=r.generator, device=device)
                for r in reqs
                if r.drafts
            ]
        )
        # u < p(d) / q(d), without dividing; a q(d) of 0 (q cannot have drawn d) rejects.
        accept = torch.cat(
            [(q_d > 0) & (uniform * q_d < p_d), drafts.new_zeros(1, dtype=torch.bool)]
        )
        pad = len(draft_rows)  # the False appended: past a request's own drafts
        grid = [
            [f + j if j < n else pad for j in range(most)]
            for f, n in zip(first_draft[:-1], counts, strict=True)
        ]
        kept = accept[to_device(grid, torch.long, device)].long().cumprod(1).sum(1)
        target = p[starts_t + kept]  # the drawn token's row
        # A rejected draft d: the residual max(0, p - q), q = one-hot(d) for a point mass.
        rejected = kept < to_device(counts, torch.long, device)
        at = (to_device(first_draft[:-1], torch.long, device) + kept).clamp(max=pad - 1)
        residual = target.clone()
        if with_q:
            q_first = list(itertools.accumulate((counts[i] for i in with_q), initial=0))[:-1]
            rows_q = to_device(with_q, torch.long, device)
            last = to_device([counts[i] - 1 for i in with_q], torch.long, device)
            q_at = q[to_device(q_first, torch.long, device) + torch.minimum(kept[rows_q], last)]
            residual[rows_q] -= q_at * rejected[rows_q, None]
        point = to_device([r.draft_probs is None for r in reqs], torch.bool, device)
        residual.scatter_add_(1, drafts[at, None], -(point & rejected).to(p.dtype)[:, None])
        residual.clamp_(min=0.0)
        # p == q up to rounding: rejection had probability ~0; p is then the residual's limit.
        target = torch.where((residual.sum(-1) > 0)[:, None], residual, target)
    drawn = inverse_cdf(target, rows)
    # Failed: a row up to the drawn token's is not finite.
    span = [[s + min(j, n) for j in range(most + 1)] for s, n in zip(starts, counts, strict=True)]
    upto = torch.arange(most + 1, device=device)[None] <= kept[:, None]
    bad = (~finite[to_device(span, torch.long, device)] & upto).any(1)
    host = torch.stack([kept, drawn, bad.long()]).tolist()
    return [
        None if failed else [*r.drafts[:n], token]
        for r, n, token, failed in zip(reqs, *host, strict=True)
    ]
