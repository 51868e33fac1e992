"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeds, penalties, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import TokenLogprobs


@dataclass
class SamplingRow:
    """What the sampler needs of one request (one row of the logits)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long
        )
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if (p.presence_penalty or p.frequency_penalty) and row.output_token_ids:
        ids, counts = torch.tensor(row.output_token_ids).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks (masked entries become -inf)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the token crossing top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _logprobs(raw: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    lp = raw.log_softmax(-1)
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    top = []
    if n > 0:
        vals, ids = lp.topk(n)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return TokenLogprobs(token, chosen, rank, top)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list]:
    """``logits``: (num_rows, vocab) float32. Returns token ids and per-row logprobs
    (None for rows that did not ask for them)."""
    raw = logits
    tokens: list[int | None] = [None] * len(rows)
    greedy = [i for i, r in enumerate(rows) if _is_plain_greedy(r.params)]
    if greedy:
        for i, t in zip(greedy, raw[greedy].argmax(-1).tolist(), strict=True):
            tokens[i] = t
    for i, row in enumerate(rows):
        if tokens[i] is not None:
            continue
        x = apply_penalties(raw[i].clone(), row)
        if row.params.sampling_type_greedy:
            tokens[i] = int(x.argmax())
            continue
        probs = _filter(x, row.params).softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=row.generator))
    logprobs = [
        _logprobs(raw[i], tokens[i], r.params.logprobs) if r.params.logprobs is not None else None
        for i, r in enumerate(rows)
    ]
    return tokens, logprobs


def _is_plain_greedy(p: SamplingParams) -> bool:
    return (
        p.sampling_type_greedy
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )
