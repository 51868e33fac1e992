"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeds, penalties, logprobs.

A row that cannot be sampled fails alone (``SamplerOutput.errors``), never the batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import RequestFailure, TokenLogprobs

logger = logging.getLogger(__name__)


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
        # float64: top_p is a Python float, which float32 would round (1e-300 to 0, so
        # that even the top token's mass before it, 0, reached it and nothing was kept).
        probs = sorted_logits.softmax(-1).double()
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        drop = before >= p.top_p  # keeps the token crossing top_p
        drop[0] = False  # and always the top token, however small top_p is
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


def token_logprobs(logits: torch.Tensor, token_ids: list[int], n: int) -> list[TokenLogprobs]:
    """Per row of ``logits`` (rows, vocab): the logprob of ``token_ids[row]``, its 1-based
    rank and the top ``n`` (the raw distribution: no penalty, temperature or filter).
    Used for prompt logprobs, where every row is a prompt position."""
    lp = logits.float().log_softmax(-1)
    targets = torch.tensor(token_ids, device=lp.device)[:, None]
    chosen = lp.gather(1, targets)  # (rows, 1)
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    top_ids, top_vals = [[]] * len(token_ids), [[]] * len(token_ids)
    if n > 0:
        vals, ids = lp.topk(n, dim=-1)
        top_ids, top_vals = ids.tolist(), vals.tolist()
    return [
        TokenLogprobs(t, v, r, list(zip(ti, tv, strict=True)))
        for t, v, r, ti, tv in zip(
            token_ids, chosen[:, 0].tolist(), ranks, top_ids, top_vals, strict=True
        )
    ]


class SamplerOutput(NamedTuple):
    """Per row: the sampled token (None for a failed row), its logprobs (None unless asked
    for, or failed), and row index -> failure for the rows that could not be sampled."""

    token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, RequestFailure]


_NON_FINITE_LOGITS = RequestFailure("the model produced NaN or infinite logits", internal=True)
_NON_FINITE_PROBS = RequestFailure(
    "sampling failed: this request's sampling parameters (penalties, temperature) turned "
    "its logits into NaN or infinity",
    internal=False,
)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """``logits``: (num_rows, vocab) float32.

    A row that cannot be sampled (non-finite logits from the model, or penalties and
    temperature that make them so, or any error while sampling it) fails alone: the other
    rows are sampled as if it were not in the batch (seeded rows use their own generator).
    """
    raw = logits
    tokens: list[int | None] = [None] * len(rows)
    errors: dict[int, RequestFailure] = {}
    # The max of a row is NaN if any entry is, +inf if any is, -inf if all are.
    for i in (~torch.isfinite(raw.amax(-1))).nonzero().flatten().tolist():
        errors[i] = _NON_FINITE_LOGITS
    greedy = [i for i, r in enumerate(rows) if _is_plain_greedy(r.params) and i not in errors]
    if greedy:
        for i, t in zip(greedy, raw[greedy].argmax(-1).tolist(), strict=True):
            tokens[i] = t
    plain = [i for i, r in enumerate(rows) if _is_plain_random(r.params) and i not in errors]
    if len(plain) > 1:
        try:
            for i, t in zip(plain, _draw_rows(raw[plain], [rows[i] for i in plain]), strict=True):
                tokens[i] = t
                if t is None:
                    errors[i] = _NON_FINITE_PROBS
        except Exception:  # the rows are sampled one by one below, each failing alone
            logger.warning("sampling rows together failed; sampling them one by one", exc_info=True)
            for i in plain:
                tokens[i] = None
                errors.pop(i, None)
    for i, row in enumerate(rows):
        if tokens[i] is not None or i in errors:
            continue
        try:
            tokens[i] = _sample_row(raw[i], row)
        except Exception as e:  # this row only; the traceback is in the engine's log
            logger.warning("sampling a row failed", exc_info=True)
            errors[i] = RequestFailure(f"sampling failed: {type(e).__name__}: {e}")
        if tokens[i] is None and i not in errors:
            errors[i] = _NON_FINITE_PROBS
    logprobs = [
        _logprobs(raw[i], t, r.params.logprobs)
        if r.params.logprobs is not None and t is not None
        else None
        for i, (r, t) in enumerate(zip(rows, tokens, strict=True))
    ]
    return SamplerOutput(tokens, logprobs, errors)


def _sample_row(raw: torch.Tensor, row: SamplingRow) -> int | None:
    """One row's token, or None if its penalised / filtered logits are not finite."""
    x = apply_penalties(raw.clone(), row)
    if row.params.sampling_type_greedy:
        return int(x.argmax()) if torch.isfinite(x.amax()) else None
    filtered = _filter(x, row.params)
    if not torch.isfinite(filtered.amax()):
        return None
    return draw(filtered.softmax(-1), row.generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from the categorical distribution ``probs`` (finite, >= 0, some > 0): the
    inverse of its CDF (float64) at one uniform number from ``generator``. Exact like
    ``torch.multinomial``, whose set-up costs ~1 ms a row on a 49k vocabulary here (0.04 ms
    this way: a 16-stream decode step spent a quarter of its time in multinomial)."""
    cdf = probs.double().cumsum(-1)
    target = torch.rand((), dtype=torch.float64, generator=generator) * cdf[-1]
    token = int(torch.searchsorted(cdf, target, right=True))  # first cdf > target: mass > 0
    if token == len(cdf):  # target rounded up to the total: the last token with mass
        token = int(torch.searchsorted(cdf, cdf[-1]))  # (the first at the total)
    return token


def _draw_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int | None]:
    """``draw`` for rows (``logits``: one per row) with a temperature and nothing else
    (``_is_plain_random``), all at once: the same tokens as row by row (each row's float32
    tempered softmax and float64 CDF, one uniform number from each row's generator, drawn
    in row order), with a few batched ops instead of ~8 per row (a 16-stream decode step
    spent ~7% of its time there). None for a row whose tempered logits are not finite."""
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)
    x = logits / temps[:, None]
    finite = torch.isfinite(x.amax(-1)).tolist()
    cdf = x.softmax(-1).double().cumsum(-1)
    uniform = torch.stack(
        [torch.rand((), dtype=torch.float64, generator=r.generator) for r in rows]
    )
    tokens = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0].tolist()
    out: list[int | None] = []
    for i, (token, ok) in enumerate(zip(tokens, finite, strict=True)):
        if token == cdf.shape[1]:  # rounded up to the total: the first token at the total
            token = int(torch.searchsorted(cdf[i], cdf[i, -1]))
        out.append(token if ok else None)
    return out


def _is_plain_random(p: SamplingParams) -> bool:
    """Random sampling with a temperature only: no penalty, top-k, top-p or min-p."""
    return (
        not p.sampling_type_greedy
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and p.top_k <= 0
        and p.top_p >= 1.0
        and p.min_p <= 0.0
    )


def _is_plain_greedy(p: SamplingParams) -> bool:
    return (
        p.sampling_type_greedy
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )
