"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeds, penalties, logprobs,
allowed_token_ids, bad_words, min_tokens (stop tokens masked until then), logit_bias.

A row that cannot be sampled fails alone (``SamplerOutput.errors``), never the batch.
Every row is sampled in one pass on the logits' device (``sample_on_device``), read back
once by ``sample``, or left there by --async-scheduling's deferred steps. Every tensor
built here lives on the logits' device and goes up without making the host wait
(``vllm/utils/device.py``), and every random number comes from that device (a seeded
row's generator is created there by the runner): on CUDA a CPU index or uniform next to
CUDA logits fails (tests/v1/sample/test_sampler_device.py checks this on CPU,
tests/cuda/test_sampling_cuda.py on a GPU)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

import numpy as np
import torch

from vllm import envs
from vllm.sampling_params import SamplingParams
from vllm.utils.device import to_device, upload
from vllm.v1.outputs import RequestFailure, TokenLogprobs
from vllm.v1.sample import triton_top_p
from vllm.v1.sample.penalty_table import PenaltyTable, has_penalty

logger = logging.getLogger(__name__)


@dataclass
class SamplingRow:
    """What the sampler needs of one request (one row of the logits)."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]  # read only by the repetition penalty
    output_token_ids: list[int]
    # The request's row in the runner's PenaltyTable (penalties from the device's tables
    # instead of the two lists above), None without one.
    penalty_slot: int | None = None


class PrefixView(Sequence[int]):
    """The first ``length`` items of ``items``, without copying them: a request's prompt
    inside its token list (a 256-request batch of 2k-token prompts would otherwise copy
    half a million ids a step for the one penalty that reads them). The runner keeps one
    per request, so ``unique_ids`` is computed once."""

    __slots__ = ("items", "length", "_unique")

    def __init__(self, items: Sequence[int], length: int) -> None:
        self.items, self.length = items, length
        self._unique: np.ndarray | None = None

    def unique_ids(self) -> np.ndarray:
        """The distinct ids, as int64, computed at the first call (the prefix never
        changes: ``items`` only grows past it)."""
        if self._unique is None:
            self._unique = np.unique(np.fromiter(self, dtype=np.int64, count=self.length))
        return self._unique

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self.items[: self.length])[index]
        if not -self.length <= index < self.length:
            raise IndexError(index)
        return self.items[index % self.length]

    def __iter__(self) -> Iterator[int]:
        return islice(self.items, self.length)


def apply_logits_processors(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """What vLLM's sampler applies before penalties and temperature, in its order:
    ``allowed_token_ids`` (every other token -inf; a row whose ``thinking_token_budget``
    is spent may sample only the next token of its reasoning's end: ``thinking_forced``);
    ``bad_words`` (-inf for the token that would complete one, given the output so far);
    ``min_tokens`` (a row with fewer outputs cannot sample a stop token: EOS unless
    ``ignore_eos``, the generation config's other EOS ids, ``stop_token_ids``);
    ``logit_bias`` (added). A copy, built with one index copy per kind to the logits'
    device for the whole batch; ``logits`` itself when no row asks for any. Stop ids past
    the logits' vocabulary (a tokenizer larger than the model's head) are left out; the
    front end refuses such ids in the other two."""
    vocab = logits.shape[-1]
    allowed: tuple[list[int], list[int]] = ([], [])  # (row, token) pairs
    masked: tuple[list[int], list[int]] = ([], [])  # bad words' next tokens, early stops
    bias: tuple[list[int], list[int], list[float]] = ([], [], [])
    for i, row in enumerate(rows):
        p = row.params
        forced = thinking_forced(row) if p.thinking_token_budget is not None else None
        if forced is not None and forced < vocab:
            allowed[0].append(i)
            allowed[1].append(forced)
        elif p.allowed_token_ids:
            allowed[0].extend([i] * len(p.allowed_token_ids))
            allowed[1].extend(p.allowed_token_ids)
        banned = _banned_words_next(row, vocab) if p.bad_words_token_ids else []
        if len(row.output_token_ids) < p.min_tokens:
            banned += [t for t in p.all_stop_token_ids if t < vocab]
        masked[0].extend([i] * len(banned))
        masked[1].extend(banned)
        if p.logit_bias:
            bias[0].extend([i] * len(p.logit_bias))
            bias[1].extend(p.logit_bias)
            bias[2].extend(p.logit_bias.values())
    if not (allowed[0] or masked[0] or bias[0]):
        return logits
    device = logits.device
    x = logits.clone()
    if allowed[0]:
        index = to_device(allowed, torch.long, device)
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[index[0], index[1]] = True
        # The rows from the host: torch.unique on a device tensor would wait for it.
        restricted = to_device(sorted(set(allowed[0])), torch.long, device)
        x[restricted] = x[restricted].masked_fill(~keep[restricted], float("-inf"))
    if masked[0]:
        index = to_device(masked, torch.long, device)
        x[index[0], index[1]] = float("-inf")
    if bias[0]:
        index = to_device(bias[:2], torch.long, device)
        values = to_device(bias[2], x.dtype, device)
        x.index_put_((index[0], index[1]), values, accumulate=True)
    return x


class _ThinkingScan:
    """How far a request's output has been searched for the end of its reasoning."""

    __slots__ = ("ended", "scanned")

    def __init__(self) -> None:
        self.ended = False
        self.scanned = 0


def thinking_forced(row: SamplingRow) -> int | None:
    """The token a row with a ``thinking_token_budget`` must sample now: once its output
    holds that many tokens and none of ``thinking_end_token_ids`` yet, the next token of
    the first end sequence (continuing a part of it already written); None otherwise. The
    output is searched incrementally (the new tokens and an end sequence's length before
    them), so a long output costs nothing per step once its reasoning ended."""
    p, out = row.params, row.output_token_ids
    ends = p.thinking_end_token_ids
    if not ends:
        return None
    scan = p.thinking_scan
    if scan is None:
        scan = p.thinking_scan = _ThinkingScan()
    if not scan.ended:
        longest = max(len(e) for e in ends)
        start = max(scan.scanned - longest + 1, 0)
        scan.ended = any(_contains(out, e, start) for e in ends)
        scan.scanned = len(out)
    if scan.ended or len(out) < p.thinking_token_budget:
        return None
    end = ends[0]
    done = max((k for k in range(len(end)) if k == 0 or out[-k:] == end[:k]), default=0)
    return end[done]


def _contains(seq: list[int], part: list[int], start: int) -> bool:
    n = len(part)
    first = part[0]
    for i in range(start, len(seq) - n + 1):
        if seq[i] == first and seq[i : i + n] == part:
            return True
    return False


def _banned_words_next(row: SamplingRow, vocab: int) -> list[int]:
    """The tokens that would complete one of the row's bad words now: a word's last token
    when the output ends with the rest of it (a one-token word: always)."""
    out = row.output_token_ids
    banned = []
    for word in row.params.bad_words_token_ids:
        head = word[:-1]
        if word[-1] < vocab and (not head or out[-len(head) :] == head):
            banned.append(word[-1])
    return banned


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """``logits`` (one row) penalised: ``apply_penalties_to_rows`` of that row alone."""
    return apply_penalties_to_rows(logits[None], [row])[0]


def apply_penalties_to_rows(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    in_place: bool = False,
    table: PenaltyTable | None = None,
) -> torch.Tensor:
    """The penalties of every row that has any, together on ``logits``' device (vLLM's
    order): repetition (a token seen in the prompt or the output: positive logits divided
    by it, negative ones multiplied), then frequency and presence (a token's count in the
    output times the one, plus the other if it occurs at all). A copy unless ``in_place``;
    ``logits`` itself when no row has a penalty.

    Sparse: only the (row, token) entries of the rows' histories are read and written
    (one copy of their ids to the device per kind; a token's count in its row by a sort
    of the entries, not a (rows, vocab) table), and nothing is read back: with
    --async-scheduling a step with penalties stays on the device. With a ``table``
    (``penalty_table.PenaltyTable``) the rows that have their ``penalty_slot`` take
    their histories from the device's tables instead, the same values to the bit."""
    penalised = [i for i, r in enumerate(rows) if has_penalty(r.params)]
    if not penalised:
        return logits
    device, dtype = logits.device, logits.dtype
    x = (
        logits
        if in_place and logits.is_contiguous()
        else logits.clone(memory_format=torch.contiguous_format)
    )
    if table is not None:
        tabled = [i for i in penalised if rows[i].penalty_slot is not None]
        if tabled:
            slots = [rows[i].penalty_slot for i in tabled]
            table.apply(x, tabled, slots, [rows[i].params for i in tabled])
            penalised = [i for i in penalised if rows[i].penalty_slot is None]
    flat_x = x.view(-1)
    vocab = x.shape[-1]
    repeating = [i for i in penalised if rows[i].params.repetition_penalty != 1.0]
    if repeating:
        where, flat = _entries(
            [(i, [_ids(rows[i].prompt_token_ids), _ids(rows[i].output_token_ids)])
             for i in repeating],
            vocab,
            device,
        )  # fmt: skip
        factor = to_device([r.params.repetition_penalty for r in rows], dtype, device)[where]
        vals = flat_x[flat]  # an entry seen twice is written twice, with the same value
        flat_x[flat] = torch.where(vals > 0, vals / factor, vals * factor)
    counting = [
        i
        for i in penalised
        if (rows[i].params.presence_penalty or rows[i].params.frequency_penalty)
        and rows[i].output_token_ids
    ]
    if counting:
        where, flat = _entries([(i, [_ids(rows[i].output_token_ids)]) for i in counting],
                               vocab, device)  # fmt: skip
        ordered = flat.sort().values
        count = torch.searchsorted(ordered, flat, right=True) - torch.searchsorted(ordered, flat)
        frequency = to_device([r.params.frequency_penalty for r in rows], dtype, device)[where]
        presence = to_device([r.params.presence_penalty for r in rows], dtype, device)[where]
        flat_x[flat] = flat_x[flat] - (frequency * count.to(dtype) + presence)
    return x


def _ids(seq: Sequence[int]) -> np.ndarray:
    """``seq`` as int64: a ``PrefixView``'s distinct ids (cached; the repetition penalty
    reads a token's presence only), else every id."""
    if isinstance(seq, PrefixView):
        return seq.unique_ids()
    return np.fromiter(seq, dtype=np.int64, count=len(seq))


def _entries(
    rows: list[tuple[int, list[np.ndarray]]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (row, its id arrays) of ``rows``, one entry per id: the row of each entry,
    and its index in the flattened (rows, vocab) logits; built on the host with numpy,
    copied to ``device`` at once. A 256-row batch of 2k-token prompts and 512 outputs of
    random ids (every prompt id distinct: the worst case) takes 11.8 ms of host time a
    step on this project's EPYC with the prompts' distinct ids cached, 19.5 ms when each
    step read every prompt id."""
    arrays = [a for _, parts in rows for a in parts]
    lengths = np.array([sum(len(a) for a in parts) for _, parts in rows], dtype=np.int64)
    ids = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    where = np.repeat(np.array([i for i, _ in rows], dtype=np.int64), lengths)
    both = upload(torch.from_numpy(np.stack([where, where * vocab + ids])), device)
    return both[0], both[1]


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masks (masked entries become -inf)."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        logits = apply_top_p(logits[None], to_device([p.top_p], torch.float64, logits.device))[0]
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


# On a CPU, how many of each row's most likely tokens top-p ranks first (all of them only
# for a row whose nucleus is wider).
TOP_P_CANDIDATES = 1024


TOP_P_METHODS = ("numpy", "sort", "triton")


def apply_top_p(x: torch.Tensor, top_p: torch.Tensor, method: str | None = None) -> torch.Tensor:
    """``x`` (rows, vocab) with every token outside each row's nucleus at -inf: the fewest
    most likely tokens whose probabilities (float32 softmax of ``x``) reach ``top_p``
    (float64, one per row; inf leaves a row alone), and every token as likely as the
    last of them (ties at the edge are kept, as top-k keeps ties with its k-th).

    The nucleus is ranked in float64 over the probabilities in descending order (float32
    would round a ``top_p`` of 1e-300 to 0, and then even the top token's mass before it,
    0, would reach it and nothing be kept). Its edge depends only on the sorted *values*,
    not on the order of ties, so a row gives the same tokens alone or in a batch, and
    whichever sort ordered it.

    Only the values are ranked, never the token ids. ``method`` (None:
    ``VLLM_TOP_P_METHOD``, whose ``auto`` is numpy on a CPU, sort elsewhere): ``numpy``
    ranks them on the host (``_nucleus_edge_on_host``; CPU tensors, else sort);
    ``sort``, ``torch.sort`` of every row, reading nothing back to the host; ``triton``,
    a search over the probabilities' bits (``triton_top_p``; float32 CUDA rows, else
    sort), to be timed against sort on a GPU (benchmarks/benchmark_sampler.py's
    ``--top-p-ab`` compares any two)."""
    probs = x.softmax(-1)
    if method is None:
        method = envs.VLLM_TOP_P_METHOD
        if method == "auto":
            method = "numpy" if x.device.type == "cpu" else "sort"
    elif method not in TOP_P_METHODS:
        raise ValueError(f"method must be one of {', '.join(TOP_P_METHODS)}, got {method!r}")
    if method == "numpy" and x.device.type == "cpu" and probs.dtype in _HOST_DTYPES:
        edge = _nucleus_edge_on_host(probs, top_p)
    elif method == "triton" and _triton_top_p_runs(probs):
        edge = triton_top_p.nucleus_edge(probs, top_p)
    else:
        edge, _ = _nucleus_edge(probs.sort(dim=-1, descending=True).values, top_p)
    return x.masked_fill(probs < edge[:, None], float("-inf"))  # edge 0: the row alone


_HOST_DTYPES = (torch.float32, torch.float64)


def _triton_top_p_runs(probs: torch.Tensor) -> bool:
    """Whether the Triton search takes these rows: float32 on CUDA (or on a CPU inside
    Triton's interpreter, the tests' way), with triton installed."""
    if probs.dtype != torch.float32 or not triton_top_p.available():
        return False
    return probs.device.type == "cuda" or triton_top_p.interpreted()


def _nucleus_edge(ranked: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of probabilities in descending order (a row's most likely tokens, or all
    of them): the probability of the last token of each row's nucleus, and whether the
    nucleus ends within the row (if not, 0: keep every token)."""
    mass = ranked.double()
    before = mass.cumsum(-1) - mass  # the mass ranked above each token
    drop = before >= top_p[:, None]  # the token crossing top_p is kept,
    drop[:, 0] = False  # and always the top token, however small top_p is
    ends = drop.any(-1)
    last = (drop.byte().argmax(-1) - 1).clamp_(min=0)  # argmax: the first True
    edge = ranked.gather(1, last[:, None])[:, 0]
    return torch.where(ends, edge, torch.zeros_like(edge)), ends


def _nucleus_edge_on_host(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``_nucleus_edge`` of CPU rows, ranked by numpy: each row's ``TOP_P_CANDIDATES``
    most likely probabilities (``np.partition``, then a sort of those), and every one
    only for the rows whose nucleus does not end among them. numpy's vectorised sort of
    values alone takes 0.74 ms for 4 rows of a 49k vocabulary on this project's Xeon,
    ``torch.sort`` (which orders the ids too) 11.3 ms; the partition and a sort of the
    candidates take less, and leave the float64 ranking a thousand tokens a row, not
    49k. A row's first candidates are the first of its whole ranking, and the running
    sum over them the same numbers: the edge is the one a sort of every token gives."""
    values = probs.numpy()
    vocab = values.shape[-1]
    k = min(TOP_P_CANDIDATES, vocab)
    top = np.partition(values, vocab - k, axis=-1)[:, vocab - k :] if k < vocab else values
    edge, ends = _nucleus_edge(_descending(top), top_p)
    wide = (~ends & torch.isfinite(top_p)).nonzero()[:, 0]  # (inf: no top-p for that row)
    if k < vocab and len(wide):
        edge[wide] = _nucleus_edge(_descending(values[wide.numpy()]), top_p[wide])[0]
    return edge


def _descending(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.sort(values, axis=-1)[:, ::-1].copy())


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], n: int, as_logits: bool = False
) -> list[TokenLogprobs]:
    """Per row of ``logits`` (rows, vocab): the logprob of ``token_ids[row]``, its 1-based
    rank and the top ``n`` (the raw distribution: no penalty, temperature or filter).
    Used for prompt logprobs, where every row is a prompt position, and for the logprobs
    of sampled tokens. Two copies to the host for all the rows (integers, then floats).
    ``as_logits``: the logits' values instead (--logprobs-mode raw_logits)."""
    targets = to_device(token_ids, torch.long, logits.device)
    ints, floats = token_logprobs_on_device(logits, targets, n, as_logits)
    return logprobs_from_host(token_ids, ints.tolist(), floats.tolist())


def token_logprobs_on_device(
    logits: torch.Tensor, targets: torch.Tensor, n: int, as_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs``' work without a copy to the host, for ``targets`` (rows,) on the
    device: (ints (rows, 1 + n): the rank, then the top ids; floats (rows, 1 + n): the
    logprob, then the top ones), for ``logprobs_from_host``. ``as_logits``: the logits'
    own values (the ranks are the same)."""
    lp = logits.float() if as_logits else logits.float().log_softmax(-1)
    targets = targets[:, None]
    chosen = lp.gather(1, targets)  # (rows, 1)
    ranks = (lp > chosen).sum(-1, keepdim=True) + 1  # (rows, 1)
    vals, ids = lp.topk(n, dim=-1) if n > 0 else (chosen[:, :0], targets[:, :0])
    return torch.cat([ranks, ids], 1), torch.cat([chosen, vals], 1)


def logprobs_from_host(
    token_ids: Sequence[int], ints: list[list[int]], floats: list[list[float]]
) -> list[TokenLogprobs]:
    """``token_logprobs_on_device``'s rows, on the host, as ``TokenLogprobs``."""
    return [
        TokenLogprobs(t, f[0], i[0], list(zip(i[1:], f[1:], strict=True)))
        for t, i, f in zip(token_ids, ints, floats, strict=True)
    ]


def sampled_logprobs_on_device(
    logits: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor, as_logits: bool = False
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """The raw logprobs of the rows that ask for them, of their tokens still on the
    device (``sample_on_device``'s), without a copy to the host: per number of top
    logprobs asked, (the rows, ints, floats) as ``token_logprobs_on_device`` gives them.
    A failed row's entry is computed too (its token id is in range) and must be dropped."""
    by_n: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r.params.logprobs is not None:
            by_n.setdefault(r.params.logprobs, []).append(i)
    groups = []
    for n, idx in by_n.items():
        if len(idx) == len(rows):
            groups.append((idx, *token_logprobs_on_device(logits, tokens, n, as_logits)))
            continue
        index = to_device(idx, torch.long, logits.device)
        groups.append((idx, *token_logprobs_on_device(logits[index], tokens[index], n, as_logits)))
    return groups


def logprobs_source(
    mode: str,
    raw: torch.Tensor,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    penalties: PenaltyTable | None = None,
) -> tuple[torch.Tensor, bool]:
    """(the logits a step's logprobs come from, whether they are reported as logits) for
    ``mode`` (--logprobs-mode, ``config.LogprobsMode``): raw (the model's, before any
    processing) or processed (``processed_logits`` of ``logits``; call it before the
    step's tokens enter ``penalties``' tables)."""
    if mode.startswith("processed"):
        return processed_logits(logits, rows, penalties), mode.endswith("_logits")
    return raw, mode.endswith("_logits")


def processed_logits(
    logits: torch.Tensor, rows: list[SamplingRow], penalties: PenaltyTable | None = None
) -> torch.Tensor:
    """The logits each row's token was drawn from, as vLLM's ``processed_*`` logprobs
    modes report them: after the logits processors and the penalties, and for a random
    row its temperature, top-k, top-p and min-p (what they filter out: -inf). The same
    ops as ``sample_on_device``, which draws no number here: recomputed, not kept, so
    the common mode costs nothing."""
    x = apply_logits_processors(logits, rows)
    x = apply_penalties_to_rows(x, rows, x is not logits, penalties)
    drawn = [i for i, r in enumerate(rows) if not r.params.sampling_type_greedy]
    if drawn:
        index = to_device(drawn, torch.long, x.device)
        filtered = filter_rows_on_device(x.index_select(0, index), [rows[i] for i in drawn])
        x = x.index_copy(0, index, filtered)
    return x


class SamplerOutput(NamedTuple):
    """Per row: the sampled token (None for a failed row), its logprobs (None unless asked
    for, or failed), and row index -> failure for the rows that could not be sampled."""

    token_ids: list[int | None]
    logprobs: list[TokenLogprobs | None]
    errors: dict[int, RequestFailure]


NON_FINITE_LOGITS = RequestFailure("the model produced NaN or infinite logits", internal=True)
_NON_FINITE_PROBS = RequestFailure(
    "sampling failed: this request's sampling parameters (penalties, temperature) turned "
    "its logits into NaN or infinity",
    internal=False,
)


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    penalties: PenaltyTable | None = None,
    raw: torch.Tensor | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> SamplerOutput:
    """``logits``: (num_rows, vocab) float32, on any device.

    Every row together (``sample_on_device``), then one copy to the host. A row that
    cannot be sampled (non-finite logits from the model, or penalties and temperature that
    make them so) fails alone: the other rows are sampled as if it were not in the batch
    (seeded rows use their own generator). Should the batch raise, the rows are sampled one
    by one, each failing alone. ``allowed_token_ids``, ``min_tokens``, ``logit_bias`` and
    the penalties apply to a copy (from ``penalties``' tables where given: the rows'
    ``penalty_slot``); the logprobs are those of ``raw`` (the model's logits before
    custom logits processors) when given, else of ``logits`` as given; or, by
    ``logprobs_mode`` (vLLM's --logprobs-mode), the processed logits, or logits instead of
    logprobs.
    """
    tokens: list[int | None] = [None] * len(rows)
    errors: dict[int, RequestFailure] = {}
    try:
        for i, result in enumerate(_read_results(*sample_on_device(logits, rows, penalties))):
            if isinstance(result, RequestFailure):
                errors[i] = result
            else:
                tokens[i] = result
    except Exception:  # the rows are sampled one by one below, each failing alone
        logger.warning("sampling rows together failed; sampling them one by one", exc_info=True)
        errors.clear()
        for i, row in enumerate(rows):
            try:
                (result,) = _read_results(*sample_on_device(logits[i : i + 1], [row], penalties))
            except Exception as e:  # this row only; the traceback is in the engine's log
                logger.warning("sampling a row failed", exc_info=True)
                result = RequestFailure(f"sampling failed: {type(e).__name__}: {e}")
            if isinstance(result, RequestFailure):
                errors[i] = result
            else:
                tokens[i] = result
    raw = logits if raw is None else raw
    if all(r.params.logprobs is None for r in rows):
        return SamplerOutput(tokens, [None] * len(rows), errors)
    source, as_logits = logprobs_source(logprobs_mode, raw, logits, rows, penalties)
    return SamplerOutput(tokens, _sampled_logprobs(source, rows, tokens, as_logits), errors)


def _read_results(
    tokens: torch.Tensor, logits_ok: torch.Tensor, ok: torch.Tensor
) -> list[int | RequestFailure]:
    """``sample_on_device``'s result on the host, one copy: each row's token, or why it
    has none."""
    values = torch.cat([tokens, logits_ok.long(), ok.long()]).tolist()
    n = len(tokens)
    return [
        row_failure(bool(values[n + i]), bool(values[2 * n + i])) or values[i] for i in range(n)
    ]


def row_failure(logits_ok: bool, ok: bool) -> RequestFailure | None:
    """Why a row sampled by ``sample_on_device`` has no token (its two flags), if so."""
    if not logits_ok:
        return NON_FINITE_LOGITS
    return None if ok else _NON_FINITE_PROBS


def finite_and_argmax(raw: torch.Tensor, greedy: list[int]) -> tuple[list[bool], list[int]]:
    """Whether each row of ``raw`` is finite, and the argmax of the ``greedy`` rows: one
    copy to the host. The max of a row is NaN if any entry is, +inf if any is, -inf if
    all are."""
    # One pass over the logits gives both: each row's max (NaN or inf if any entry is) and
    # where it is (the first maximal entry, as argmax; a row that is not finite has no
    # token anyway).
    maxima, argmax = raw.max(-1)
    finite = torch.isfinite(maxima).long()
    if not greedy:
        return [bool(f) for f in finite.tolist()], []
    n = raw.shape[0]
    if len(greedy) < n:
        argmax = argmax[greedy]
    values = torch.cat([finite, argmax]).tolist()
    return [bool(f) for f in values[:n]], values[n:]


def _sampled_logprobs(
    source: torch.Tensor, rows: list[SamplingRow], tokens: list[int | None], as_logits: bool
) -> list[TokenLogprobs | None]:
    """The logprobs (of ``source``) of each sampled token whose request asks for them
    (``sampled_logprobs_on_device``, read back); None for the others and failed rows."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    ids = [0 if t is None else t for t in tokens]  # a failed row's entry is dropped
    targets = to_device(ids, torch.long, source.device)
    groups = sampled_logprobs_on_device(source, rows, targets, as_logits)
    for idx, ints, floats in groups:
        entries = logprobs_from_host([ids[i] for i in idx], ints.tolist(), floats.tolist())
        for i, entry in zip(idx, entries, strict=True):
            if tokens[i] is not None:
                out[i] = entry
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token from the categorical distribution ``probs`` (finite, >= 0, some > 0): the
    inverse of its CDF (float64) at one uniform number from ``generator`` (None: the global
    RNG of ``probs``' device; otherwise a generator of that device). Exact like
    ``torch.multinomial``, whose set-up costs ~1 ms a row on a 49k vocabulary here (0.04 ms
    this way: a 16-stream decode step spent a quarter of its time in multinomial)."""
    cdf = probs.double().cumsum(-1)
    uniform = torch.rand((), dtype=torch.float64, generator=generator, device=cdf.device)
    token = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True))  # first cdf > target
    if token == len(cdf):  # target rounded up to the total: the last token with mass
        token = int(torch.searchsorted(cdf, cdf[-1]))  # (the first at the total)
    return token


def filter_rows_on_device(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """``filter_logits`` of every row at once, each with its own temperature, top-k, top-p
    and min-p (random rows): the same masks as row by row, in batched ops on ``logits``'
    device. A filter no row asks for costs nothing."""
    device, dtype = logits.device, logits.dtype
    params = [r.params for r in rows]
    temps = to_device([p.temperature for p in params], dtype, device)
    x = logits / temps[:, None]
    vocab = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):  # each row's k-th largest value (-inf: no top-k)
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(1, to_device([max(k, 1) - 1 for k in ks], torch.long, device)[:, None])
        has_k = to_device([k > 0 for k in ks], torch.bool, device)[:, None]
        x = x.masked_fill(x < torch.where(has_k, kth, float("-inf")), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        x = apply_top_p(x, to_device(top_p, torch.float64, device))
    if any(p.min_p > 0.0 for p in params):
        probs = x.softmax(-1)
        min_p = to_device([p.min_p for p in params], probs.dtype, device)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    return x


_CPU_DRAW_ROWS = 4  # rows drawn together on a CPU (measured: 2, 4 and 8 alike, 1 and all slower)


def _draw_rows_on_device(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per random row (``logits``: penalised, not yet filtered), all on the
    device: each row's filters (``filter_rows_on_device``), its float32 softmax and
    float64 CDF, one uniform number from its generator (None: the device's global RNG),
    drawn in row order; the inverse CDF at it, as ``draw`` (the same tokens as ``draw`` row
    by row, in a few batched ops instead of ~8 per row). Returns (tokens, whether each
    row's filtered logits are finite). On a CPU, 4 rows at a time: a row's float64 CDF
    stays in cache (256 rows of 128k tokens: 43 ms in chunks against 238 ms at once, on
    this project's 2-core EPYC), drawn in the same order."""
    device = logits.device
    if device.type == "cpu" and len(rows) > _CPU_DRAW_ROWS:
        parts = [
            _draw_rows_on_device(logits[i : i + _CPU_DRAW_ROWS], rows[i : i + _CPU_DRAW_ROWS])
            for i in range(0, len(rows), _CPU_DRAW_ROWS)
        ]
        return torch.cat([t for t, _ in parts]), torch.cat([f for _, f in parts])
    x = filter_rows_on_device(logits, rows)
    return inverse_cdf(x.softmax(-1), rows), torch.isfinite(x.amax(-1))


def draw_with_probs_on_device(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_draw_rows_on_device`` (without its CPU chunks) that also returns the
    distributions drawn from: (tokens, probs (rows, vocab), whether each row's filtered
    logits are finite), all on the device. A drafter needs its q for speculative
    sampling's ratio test (``rejection_sampler.verify_sampled``)."""
    x = filter_rows_on_device(logits, rows)
    probs = x.softmax(-1)
    return inverse_cdf(probs, rows), probs, torch.isfinite(x.amax(-1))


def inverse_cdf(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of ``probs`` at one uniform number from each row's generator,
    in row order (as ``draw``, batched)."""
    device = probs.device
    cdf = probs.double().cumsum(-1)  # (rows, vocab)
    uniform = torch.stack(
        [torch.rand((), dtype=torch.float64, generator=r.generator, device=device) for r in rows]
    )
    total = cdf[:, -1:].contiguous()  # (rows, 1)
    tokens = torch.searchsorted(cdf, uniform[:, None] * total, right=True)[:, 0]
    # A target rounded up to the total falls past the end: the first token at the total.
    at_total = torch.searchsorted(cdf, total)[:, 0]
    tokens = torch.where(tokens == cdf.shape[1], at_total, tokens)
    # A row that is not finite (flagged) searches a NaN CDF and lands past the end: a
    # token id the model does not have, which a step scheduled ahead would embed (on CUDA
    # a device-side assert, fatal to the process). Any id in range will do there.
    return tokens.clamp_(max=cdf.shape[1] - 1)


def is_bare_greedy(p: SamplingParams) -> bool:
    """A greedy request that nothing else touches (no penalty, logits processor, grammar,
    thinking budget or logprobs): its token is the argmax of the model's logits, which the
    runner takes for a batch of such rows in one copy, without ``sample``'s per-row work."""
    return p.sampling_type_greedy and p.logprobs is None and is_bare(p)


def is_bare(p: SamplingParams) -> bool:
    """A request whose token needs the model's logits and its own generator alone: greedy
    or random (temperature, top-k, top-p, min-p), without penalties, logits processors,
    grammar or thinking budget (logprobs are of the logits alone too):
    ``sample_on_device`` needs nothing of its history, so a step of such rows leaves the
    device without waiting for the steps before it (--async-scheduling)."""
    return not has_penalty(p) and unprocessed(p)


def unprocessed(p: SamplingParams) -> bool:
    """No logits processor, grammar or thinking budget."""
    return (
        p.allowed_token_ids is None
        and not p.bad_words_token_ids
        and p.min_tokens == 0
        and not p.logit_bias
        and p.thinking_token_budget is None
        and p.structured_outputs is None
    )


def sample_on_device(
    logits: torch.Tensor, rows: list[SamplingRow], penalties: PenaltyTable | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's token without a copy to the host: (tokens, whether each row's logits
    are finite after the logits processors, whether its penalised and filtered logits
    are), all on ``logits``' device. The processors (``apply_logits_processors``) and the
    penalties (``apply_penalties_to_rows``) apply to a copy; greedy rows take the argmax,
    random ones their temperature, top-k, top-p and min-p and one uniform number each
    from their generator, in row order (``_draw_rows_on_device``). A grammar's mask, if
    any, is already in ``logits``. With --async-scheduling this is the whole sampling of a
    deferred step; the processors, and the penalties without ``penalties``' tables, need
    each row's output up to the step (the runner lands the earlier deferred steps first),
    the tables count the tokens of the steps before on the device."""
    processed = apply_logits_processors(logits, rows)
    logits_ok = torch.isfinite(processed.amax(-1))
    x = apply_penalties_to_rows(processed, rows, processed is not logits, penalties)
    penalised = any(has_penalty(r.params) for r in rows)
    ok = torch.isfinite(x.amax(-1)) if penalised else logits_ok
    drawn = [i for i, r in enumerate(rows) if not r.params.sampling_type_greedy]
    if drawn and len(drawn) == len(rows):  # no greedy row: no argmax
        tokens, drawn_ok = _draw_rows_on_device(x, rows)
        return tokens, logits_ok, ok & drawn_ok
    tokens = x.argmax(-1)
    if drawn:
        index = to_device(drawn, torch.long, logits.device)
        sampled, drawn_ok = _draw_rows_on_device(x[index], [rows[i] for i in drawn])
        tokens = tokens.index_copy(0, index, sampled)
        ok = ok.index_copy(0, index, ok[index] & drawn_ok)
    return tokens, logits_ok, ok
