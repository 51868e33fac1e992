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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.sampler import draw, filter_logits


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """A row's sampling distribution (temperature, then top-k / top-p / min-p), or None
    when its logits are not finite."""
    filtered = filter_logits(logits, params)
    if not torch.isfinite(filtered.amax()):
        return None
    return filtered.softmax(-1)


def verify_sampled(
    logits: torch.Tensor,
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int] | None:
    """The tokens of one request's step: ``logits`` (len(drafts) + 1, vocab), row i the
    distribution after the first i drafts; ``draft_probs`` (len(drafts), vocab): the q each
    draft was drawn from (None: point masses). None when a row needed is not finite."""
    for i, draft in enumerate(drafts):
        p = target_probs(logits[i], params)
        if p is None:
            return None
        q = None if draft_probs is None else draft_probs[i].to(p.device, p.dtype)
        q_draft = 1.0 if q is None else q[draft].item()
        uniform = torch.rand((), dtype=torch.float64, generator=generator, device=p.device)
        # u < p(d) / q(d), without dividing; a q(d) of 0 (q cannot have drawn d) rejects.
        if q_draft > 0.0 and uniform.item() * q_draft < p[draft].item():
            continue  # kept
        if q is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - q).clamp_(min=0.0)
            if not residual.sum().item() > 0.0:  # p == q up to rounding: rejection had
                residual = p  # probability ~0; p is then the residual's limit
        return [*drafts[:i], draw(residual, generator)]
    p = target_probs(logits[len(drafts)], params)
    return None if p is None else [*drafts, draw(p, generator)]
