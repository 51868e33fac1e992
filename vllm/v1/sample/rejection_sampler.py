"""Checking draft tokens of a sampled request (speculative decoding), exactly.

The drafts of n-gram lookup are certain guesses (their distribution is one token), so
speculative sampling's test reduces to: keep draft d with probability p(d), the target
distribution's mass on it after the request's temperature, top-k, top-p and min-p; at the
first draft not kept, draw the next token from p without d (renormalised); after the last
kept draft, draw from the next row's p. Each token then has exactly the distribution
plain sampling would give it (Leviathan et al., 2023; vLLM's rejection sampler with
one-hot draft probabilities). The random numbers come from the request's generator
(seeded requests stay reproducible, though not token-for-token equal to plain decoding).
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
) -> list[int] | None:
    """The tokens of one request's step: ``logits`` (len(drafts) + 1, vocab), row i the
    distribution after the first i drafts. None when a row needed is not finite."""
    for i, draft in enumerate(drafts):
        p = target_probs(logits[i], params)
        if p is None:
            return None
        uniform = torch.rand((), dtype=torch.float64, generator=generator, device=p.device)
        if uniform.item() < p[draft].item():
            continue  # kept
        residual = p.clone()
        residual[draft] = 0.0
        return [*drafts[:i], draw(residual, generator)]
    p = target_probs(logits[len(drafts)], params)
    return None if p is None else [*drafts, draw(p, generator)]
