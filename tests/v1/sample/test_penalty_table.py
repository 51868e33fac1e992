"""The penalties from per-request token tables (``PenaltyTable``) against the sparse way
(``apply_penalties_to_rows`` from the rows' histories): the same values to the bit, rows
kept apart, counts from the host and from the device alike, a failed row's token not
counted, rows reused and grown without losing any, bad input refused whole."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.penalty_table import PenaltyTable, has_penalty
from vllm.v1.sample.sampler import SamplingRow, apply_penalties_to_rows, sample_on_device

VOCAB = 300

PARAMS = [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.4),
    dict(presence_penalty=-0.7),
    dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=0.5),
    dict(),  # no penalty: its row untouched
    dict(repetition_penalty=1.1, presence_penalty=0.2),
]


def _rows(rng: np.random.Generator, params=PARAMS) -> list[SamplingRow]:
    rows = []
    for kw in params:
        prompt = rng.integers(0, VOCAB, size=int(rng.integers(0, 40))).tolist()
        output = rng.integers(0, VOCAB, size=int(rng.integers(0, 30))).tolist()
        rows.append(SamplingRow(SamplingParams(temperature=0.0, **kw), None, prompt, output))
    return rows


def _logits(rng: np.random.Generator, n: int) -> torch.Tensor:
    x = torch.from_numpy(rng.normal(0, 3, size=(n, VOCAB)).astype(np.float32))
    x[:, :4] = torch.tensor([0.0, -0.0, float("-inf"), float("inf")])  # signs and ends
    x[0, 5] = float("nan")
    return x


def _with_table(rows: list[SamplingRow], table: PenaltyTable) -> list[SamplingRow]:
    for r in rows:
        if has_penalty(r.params):
            r.penalty_slot = table.add(r.prompt_token_ids, r.output_token_ids)
    return rows


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)  # -0.0 and 0.0, NaNs compared as bits


@pytest.mark.parametrize("seed", range(5))
def test_table_gives_the_sparse_values_to_the_bit(seed):
    rng = np.random.default_rng(seed)
    rows = _rows(rng)
    x = _logits(rng, len(rows))
    sparse = apply_penalties_to_rows(x, rows)
    table = PenaltyTable(VOCAB, "cpu", capacity=2)  # grows on the way
    dense = apply_penalties_to_rows(x, _with_table(rows, table), table=table)
    assert torch.equal(_bits(dense), _bits(sparse))
    assert torch.equal(_bits(dense[4]), _bits(x[4]))  # the row without a penalty
    assert dense.data_ptr() != x.data_ptr()  # a copy unless in_place
    assert table.num_used == 5 and table.capacity == 8


def test_rows_without_a_row_in_the_table_take_the_sparse_way_beside_it():
    rng = np.random.default_rng(9)
    rows = _rows(rng)
    x = _logits(rng, len(rows))
    sparse = apply_penalties_to_rows(x, rows)
    table = PenaltyTable(VOCAB, "cpu")
    _with_table(rows[:3], table)  # rows 3..5 have none (the runner's tables turned off)
    assert torch.equal(_bits(apply_penalties_to_rows(x, rows, table=table)), _bits(sparse))


def test_rows_are_kept_apart_in_any_batch_order():
    rng = np.random.default_rng(7)
    rows = _rows(rng)
    table = PenaltyTable(VOCAB, "cpu")
    _with_table(rows, table)
    x = _logits(rng, len(rows))
    whole = apply_penalties_to_rows(x, rows, table=table)
    order = [3, 0, 5]  # a later batch: some of the requests, another order
    part = apply_penalties_to_rows(x[order], [rows[i] for i in order], table=table)
    assert torch.equal(_bits(part), _bits(whole[order]))


def test_counts_from_the_host_and_the_device_agree_and_a_failed_row_is_not_counted():
    rng = np.random.default_rng(3)
    rows = _rows(rng, [dict(frequency_penalty=0.5, repetition_penalty=1.2)] * 4)
    rows[3].output_token_ids = []  # its sampling fails each step: no token of its own
    late = PenaltyTable(VOCAB, "cpu", width=4)  # the lists widen on the way
    slots = [late.add(r.prompt_token_ids, []) for r in rows]
    for j in range(max(len(r.output_token_ids) for r in rows)):  # a token a step, as decoding
        step = [(s, r.output_token_ids[j]) for s, r in zip(slots, rows, strict=True)
                if j < len(r.output_token_ids)]  # fmt: skip
        if j % 2:
            late.record([s for s, _ in step], [t for _, t in step])
        else:
            keep = torch.ones(len(step) + 1, dtype=torch.bool)
            keep[-1] = False  # the failed row: its token (9 here) is not its request's
            late.record_on_device(
                [s for s, _ in step] + [slots[3]], torch.tensor([t for _, t in step] + [9]), keep
            )
    for r, s in zip(rows, slots, strict=True):
        r.penalty_slot = s
    x = _logits(rng, len(rows))
    histories = [SamplingRow(r.params, None, r.prompt_token_ids, r.output_token_ids) for r in rows]
    assert torch.equal(
        _bits(apply_penalties_to_rows(x, rows, table=late)),
        _bits(apply_penalties_to_rows(x, histories)),
    )
    assert int(late.counts[slots[3]].sum()) == 0 and late.lengths[slots[3]] > 0


def test_a_reused_row_read_past_its_end_gives_the_sparse_values():
    rng = np.random.default_rng(5)
    long, short, other = _rows(rng, [dict(repetition_penalty=1.4, presence_penalty=0.6)] * 3)
    long.prompt_token_ids, short.prompt_token_ids = list(range(100, 160)), [7]
    short.output_token_ids, other.output_token_ids = [8], list(range(200, 290))
    table = PenaltyTable(VOCAB, "cpu", capacity=2, width=8)
    _with_table([long, other], table)
    table.remove(long.penalty_slot)  # its 60 listed tokens stay in the row's list
    _with_table([short], table)
    assert short.penalty_slot == long.penalty_slot and table.lengths[short.penalty_slot] == 2
    x = _logits(rng, 2)
    batch = [other, short]  # 90 tokens wide: short's list read past its end, over long's
    assert torch.equal(
        _bits(apply_penalties_to_rows(x, batch, table=table)),
        _bits(apply_penalties_to_rows(x, [dataclasses.replace(r, penalty_slot=None)
                                          for r in batch])),
    )  # fmt: skip


def test_a_removed_row_is_reused_clean():
    table = PenaltyTable(VOCAB, "cpu", capacity=2)
    a = table.add([1, 2, 3], [4, 4])
    b = table.add([5], [])
    table.remove(a)
    c = table.add([], [9])
    assert c == a and table.num_used == 2
    assert table.in_prompt[c].sum() == 0 and table.counts[c].sum() == 1 and table.counts[c, 9] == 1
    assert table.in_prompt[b, 5] and table.counts[b].sum() == 0
    d = table.add([7], [])  # the third: the table doubles, the rows in use unchanged
    assert table.capacity == 4 and d == 2
    assert table.in_prompt[b, 5] and table.counts[c, 9] == 1
    with pytest.raises(ValueError, match="slot 3 is not in use"):
        table.remove(3)
    table.remove(d)
    with pytest.raises(ValueError, match="slot 2 is not in use"):
        table.remove(d)


def test_bad_input_is_refused_and_takes_no_row():
    table = PenaltyTable(VOCAB, "cpu", capacity=1)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 300\): got 1 to 300"):
        table.add([1, 300], [])
    with pytest.raises(ValueError, match="got -1"):
        table.add([], [-1])
    assert table.num_used == 0
    slot = table.add([1], [])
    assert slot == 0 and table.capacity == 1
    row = SamplingRow(SamplingParams(repetition_penalty=1.5), None, [1], [], penalty_slot=slot)
    with pytest.raises(ValueError, match="logits have 301 tokens, the table 300"):
        apply_penalties_to_rows(torch.zeros(1, VOCAB + 1), [row], table=table)
    with pytest.raises(ValueError, match="vocab must be positive"):
        PenaltyTable(0, "cpu")


def test_sample_on_device_draws_the_same_tokens_with_a_table():
    rng = np.random.default_rng(11)
    params = [
        dict(repetition_penalty=1.5, temperature=0.0),
        dict(frequency_penalty=2.0, temperature=0.9, seed=3),
        dict(temperature=0.7, top_p=0.9, seed=4),
        dict(presence_penalty=1.0, top_k=20, temperature=1.0, seed=5),
    ]
    x = _logits(rng, len(params))
    x[0, 5] = 0.0  # every row finite: each draws a token

    def rows():
        out = []
        for i, kw in enumerate(params):
            p = SamplingParams(**kw)
            gen = None if p.seed is None else torch.Generator().manual_seed(p.seed)
            prompt, output = list(range(i, 60 + i)), list(range(100, 100 + 5 * i))
            out.append(SamplingRow(p, gen, prompt, output))
        return out

    sparse = sample_on_device(x, rows())
    table = PenaltyTable(VOCAB, "cpu")
    dense = sample_on_device(x, _with_table(rows(), table), table)
    for a, b in zip(sparse, dense, strict=True):
        assert torch.equal(a, b)
