"""The sampler: greedy, temperature, top-k / top-p / min-p, seeds, penalties, logprobs.

Contract (``sample`` and its caller ``ModelRunner.execute_model``): one row of logits per
request; greedy (temperature < 1e-5) is the argmax of the penalised logits; otherwise one
draw from softmax(filtered(penalised / temperature)) with the row's own generator (None:
the global RNG). Logprobs are of the *raw* logits, whatever the filters did.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.sampler import (
    PrefixView,
    SamplingRow,
    apply_penalties,
    apply_penalties_to_rows,
    apply_top_p,
    draw,
    filter_logits,
    is_bare,
    logprobs_from_host,
    sample,
    sample_on_device,
    sampled_logprobs_on_device,
    token_logprobs,
)

VOCAB = 8


def row(
    seed: int | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    **params,
) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(seed=seed, **params), gen, prompt or [], output or [])


def draws(logits: torch.Tensor, n: int, seed: int = 0, **params) -> Counter:
    """``n`` tokens from one request with a seeded generator (same row, re-sampled)."""
    r = row(seed=seed, **params)
    return Counter(sample(logits[None, :].clone(), [r])[0][0] for _ in range(n))


# -- greedy --------------------------------------------------------------------------------
def test_greedy_is_argmax_per_row():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 4.0, 1.0], [-3.0, -2.0, -1.0, -4.0]])
    tokens, lps, _ = sample(logits, [row(temperature=0.0) for _ in range(3)])
    assert tokens == [1, 0, 2]
    assert lps == [None, None, None]


def test_tiny_temperature_counts_as_greedy_and_ignores_the_generator():
    # 1e-6 < 1e-5: greedy, so two differently seeded rows agree on the argmax.
    logits = torch.tensor([[1.0, 1.5, 1.4, 0.0]] * 2)
    tokens, _, _ = sample(logits, [row(seed=1, temperature=1e-6), row(seed=2, temperature=1e-6)])
    assert tokens == [1, 1]


def test_sample_does_not_mutate_the_logits():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows = [
        row(temperature=0.0, repetition_penalty=1.5, prompt=[0, 1, 2]),
        row(seed=3, temperature=0.7, top_k=3, top_p=0.9, presence_penalty=1.0, output=[4]),
        row(temperature=0.0),
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


# -- temperature ---------------------------------------------------------------------------
def test_filter_divides_by_temperature():
    logits = torch.tensor([1.0, -2.0, 4.0, 0.5])
    out = filter_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(out, torch.tensor([2.0, -4.0, 8.0, 1.0]))


@pytest.mark.parametrize(("temperature", "p1"), [(1.0, 0.75), (2.0, 3**0.5 / (1 + 3**0.5))])
def test_temperature_sets_the_sampling_distribution(temperature, p1):
    # logits [0, ln 3]: P(token 1) = 3^(1/T) / (1 + 3^(1/T)): 0.75 at T=1, 0.634 at T=2.
    logits = torch.tensor([0.0, math.log(3.0)])
    n = 4000
    freq = draws(logits, n, temperature=temperature)[1] / n
    assert abs(freq - p1) < 0.03  # ~4 standard deviations at n=4000


def test_low_temperature_concentrates_on_the_argmax():
    logits = torch.tensor([0.0, 1.0, 0.5, 0.9])
    assert draws(logits, 300, temperature=0.01) == Counter({1: 300})


# -- top-k / top-p / min-p -----------------------------------------------------------------
def test_top_k_never_samples_outside_the_k_largest():
    logits = torch.tensor([2.0, 0.0, 1.9, 0.1, 1.8, 0.2, 0.3, 1.7])
    seen = draws(logits, 2000, temperature=1.0, top_k=3)
    assert set(seen) == {0, 2, 4}  # all three kept tokens appear, nothing else


def test_top_k_ties_at_the_kth_value_are_kept():
    # Like vLLM, the mask is ``logits < kth``: a tie with the k-th value survives.
    out = filter_logits(torch.tensor([3.0, 1.0, 1.0, 0.0]), SamplingParams(top_k=2))
    assert torch.isfinite(out).tolist() == [True, True, True, False]


def test_top_k_at_least_vocab_is_disabled():
    out = filter_logits(torch.tensor([3.0, 1.0, 0.0]), SamplingParams(top_k=3))
    assert torch.isfinite(out).all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05 (shuffled positions). top_p=0.7: 0.5 < 0.7 so the token
    # crossing 0.7 (0.3, cumulative 0.8) is kept, then cumulative-before 0.8 >= 0.7 drops
    # the rest.
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log()
    out = filter_logits(logits, SamplingParams(top_p=0.7))
    assert torch.isfinite(out).tolist() == [False, True, False, True]
    seen = draws(logits, 2000, temperature=1.0, top_p=0.7)
    assert set(seen) == {1, 3}
    # Renormalised over the kept set: 0.5 / 0.8 = 0.625 for token 1.
    assert abs(seen[1] / 2000 - 0.625) < 0.05


def test_top_p_below_the_top_probability_keeps_only_the_top_token():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    assert draws(logits, 200, temperature=1.0, top_p=0.1) == Counter({1: 200})


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_top_p_below_float32_resolution_keeps_the_top_token(top_p):
    # A valid top_p that float32 rounds to 0: the top token still crosses it (before, the
    # row failed as if its penalties had made the logits non-finite).
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    assert torch.isfinite(filter_logits(logits, SamplingParams(top_p=top_p))).tolist() == [
        False,
        True,
        False,
        False,
    ]
    out = sample(logits[None, :].clone(), [row(seed=0, temperature=1.0, top_p=top_p)])
    assert out.token_ids == [1] and not out.errors


def test_top_p_keeps_every_tie_of_the_token_crossing_it():
    # probs 0.4, 0.2, 0.2, 0.2: the first 0.2 crosses 0.5 and is kept, and so are the
    # other two, as likely as it (whichever a sort would have put first), as top-k keeps
    # ties with its k-th.
    logits = torch.tensor([0.2, 0.4, 0.2, 0.2, 0.0]).clamp(min=1e-9).log()
    for method in ("numpy", "sort"):
        out = apply_top_p(logits[None], torch.tensor([0.5], dtype=torch.float64), method)
        assert torch.isfinite(out[0]).tolist() == [True, True, True, True, False]
    assert torch.isfinite(filter_logits(logits, SamplingParams(top_p=0.5))).sum() == 4


def _nucleus_rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of every shape a nucleus takes: peaked, flat, a wide band of equal logits at
    the edge, -inf entries (top-k before), no top-p, top_p near 0 and 1, a NaN row."""
    gen = torch.Generator().manual_seed(0)
    rows, top_p = [], []
    for scale, p in [(8.0, 0.9), (1.0, 0.95), (0.1, 0.5), (4.0, 0.999), (3.0, 1e-300), (2.0, 0.7)]:
        rows.append(torch.randn(vocab, generator=gen) * scale)
        top_p.append(p)
    band = torch.full((vocab,), -5.0)
    band[7] = 3.0
    band[10:60] = 1.0  # 50 ties: the edge ties with every candidate past the first
    rows.append(band)
    top_p.append(0.6)
    topk = torch.randn(vocab, generator=gen) * 2
    topk[topk < topk.quantile(0.9)] = float("-inf")
    rows += [topk, torch.randn(vocab, generator=gen)]
    top_p += [0.8, float("inf")]
    nan = torch.randn(vocab, generator=gen)
    nan[3] = float("nan")
    rows.append(nan)
    top_p.append(0.9)
    return torch.stack(rows), torch.tensor(top_p, dtype=torch.float64)


@pytest.mark.parametrize("candidates", [1, 8, 64, 1024])
def test_top_p_ranked_by_numpy_equals_torch_s_sort_alone_and_in_a_batch(monkeypatch, candidates):
    # On a CPU numpy ranks the probabilities (values only): each row's most likely
    # candidates first, all of them for the rows whose nucleus is wider (1: every row
    # with more than one token kept; 1024: more than the vocabulary, one sort). Elsewhere
    # torch sorts every row. All give exactly the same mask, in a batch and row by row.
    from vllm.v1.sample import sampler

    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", candidates)
    x, top_p = _nucleus_rows(300)
    by_torch = apply_top_p(x, top_p, method="sort")
    by_numpy = apply_top_p(x, top_p)
    assert torch.equal(by_torch[:-1], by_numpy[:-1])
    assert torch.isnan(by_numpy[-1]).any() and torch.isnan(by_torch[-1]).any()  # fails
    for i in range(len(x) - 1):
        assert torch.equal(apply_top_p(x[i : i + 1], top_p[i : i + 1])[0], by_numpy[i])
    kept = torch.isfinite(by_numpy).sum(-1).tolist()
    assert kept[6] == 51 and kept[7] <= 30 and kept[8] == 300  # the band, top-k, no top-p
    assert kept[4] == 1  # top_p below float32's resolution: the top token alone
    assert kept[0] == 1 and 1 < kept[5] < kept[1] < 300  # peaked rows narrower than flat ones


def test_top_k_then_top_p_compose():
    # top_k=3 keeps 0.4, 0.3, 0.2 (renormalised 4/9, 3/9, 2/9); top_p=0.5 then keeps
    # 4/9 (< 0.5) and the crossing 3/9: tokens 2 and 0.
    logits = torch.tensor([0.3, 0.1, 0.4, 0.2]).log()
    seen = draws(logits, 1000, temperature=1.0, top_k=3, top_p=0.5)
    assert set(seen) == {0, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    # max prob 0.5; min_p=0.3 keeps probs >= 0.15: 0.5, 0.3, 0.15 (not 0.05).
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    seen = draws(logits, 2000, temperature=1.0, min_p=0.3)
    assert set(seen) == {0, 1, 3}


# -- seeds ---------------------------------------------------------------------------------
def _seq(logits: torch.Tensor, rows: list[SamplingRow], steps: int, index: int) -> list[int]:
    return [sample(logits.clone(), rows)[0][index] for _ in range(steps)]


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.zeros(1, 64)  # uniform over 64 tokens: a collision of 20 draws is ~0
    a = _seq(logits, [row(seed=7)], 20, 0)
    b = _seq(logits, [row(seed=7)], 20, 0)
    c = _seq(logits, [row(seed=8)], 20, 0)
    assert a == b
    assert a != c


def test_seeded_row_is_independent_of_batch_composition():
    # Each seeded row draws from its own generator, so neighbours (unseeded random rows
    # using the global RNG, greedy rows, other seeds) do not change its tokens.
    alone = _seq(torch.zeros(1, 64), [row(seed=123, temperature=0.9)], 15, 0)
    torch.manual_seed(999)
    batch = [
        row(temperature=1.0),
        row(temperature=0.0),
        row(seed=123, temperature=0.9),
        row(seed=5, temperature=1.0, top_k=10),
    ]
    logits = torch.zeros(4, 64)
    logits[1, 17] = 1.0
    mixed = _seq(logits, batch, 15, 2)
    assert mixed == alone


def test_unseeded_rows_follow_the_global_rng():
    logits = torch.zeros(1, 64)
    torch.manual_seed(42)
    a = _seq(logits, [row()], 10, 0)
    torch.manual_seed(42)
    b = _seq(logits, [row()], 10, 0)
    assert a == b


# -- mixed batches -------------------------------------------------------------------------
def test_mixed_batch_greedy_rows_are_argmax_random_rows_respect_their_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=g)
    top2_row1 = set(logits[1].topk(2).indices.tolist())
    for step in range(200):
        rows = [
            row(temperature=0.0),
            row(seed=step, temperature=1.5, top_k=2),
            row(temperature=0.0, logprobs=1),
            row(seed=1000 + step, temperature=1.0, top_k=1),  # top_k=1 is greedy too
        ]
        tokens, lps, _ = sample(logits, rows)
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] in top2_row1
        assert tokens[2] == int(logits[2].argmax())
        assert tokens[3] == int(logits[3].argmax())
        assert lps[0] is None and lps[1] is None and lps[3] is None
        assert lps[2].token_id == tokens[2]


# -- penalties -----------------------------------------------------------------------------
def test_repetition_penalty_scales_seen_tokens_by_sign():
    # Seen (prompt or output): positive logits divided, negative multiplied; unseen kept.
    logits = torch.tensor([2.0, -1.0, 3.0, 0.5])
    out = apply_penalties(logits.clone(), row(repetition_penalty=2.0, prompt=[0], output=[1]))
    assert out.tolist() == [1.0, -2.0, 3.0, 0.5]


def test_presence_and_frequency_penalties_use_output_counts_only():
    # token 2 output twice: 3.0 - 2*0.5 - 1.0 = 1.0; token 0 in the prompt only: unchanged.
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    r = row(presence_penalty=1.0, frequency_penalty=0.5, prompt=[0], output=[2, 2, 3])
    out = apply_penalties(logits.clone(), r)
    assert out.tolist() == [1.0, 2.0, 1.0, 2.5]


def test_greedy_with_repetition_penalty_takes_the_penalised_argmax():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    tokens, _, _ = sample(logits, [row(temperature=0.0, repetition_penalty=2.0, output=[0])])
    assert tokens == [1]  # 3.0 / 2 = 1.5 < 2.0


def test_repetition_penalty_with_no_history_is_a_no_op():
    logits = torch.tensor([[0.5, 2.0, 1.0]])
    assert sample(logits, [row(temperature=0.0, repetition_penalty=1.3)])[0] == [1]


def _penalised_by_hand(logits: list[float], r: SamplingRow) -> list[float]:
    """The penalties as their definitions read, one token at a time (the reference)."""
    p, out = r.params, list(r.output_token_ids)
    seen = set(r.prompt_token_ids) | set(out)
    x = list(logits)
    for t in range(len(x)):
        if p.repetition_penalty != 1.0 and t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        if out.count(t):
            x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def test_penalties_of_a_batch_equal_each_row_by_hand():
    # Rows with one penalty, all three, none, and one with no output yet, together.
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4)) * 3
    rows = [
        row(repetition_penalty=1.5, prompt=[0, 1], output=[1, 6]),
        row(presence_penalty=0.5, frequency_penalty=0.25, prompt=[2], output=[3, 3, 7, 3]),
        row(prompt=[0, 1, 2], output=[4, 4]),
        row(repetition_penalty=0.8, presence_penalty=-0.3, frequency_penalty=1.0,
            prompt=[5, 5], output=[2, 5, 2]),
        row(presence_penalty=2.0, prompt=[1, 2, 3]),
    ]  # fmt: skip
    got = apply_penalties_to_rows(logits, rows)
    assert got is not logits and torch.equal(logits, logits.clone())  # a copy
    for i, r in enumerate(rows):
        expected = torch.tensor(_penalised_by_hand(logits[i].tolist(), r))
        torch.testing.assert_close(got[i], expected, rtol=1e-6, atol=1e-6)
    plain = [row(prompt=[1], output=[2])]
    assert torch.equal(apply_penalties_to_rows(logits[:1], plain), logits[:1])


def test_a_prompt_view_gives_the_penalty_of_its_prompt_and_reads_it_once():
    # The runner's prompt is a view into the request's growing token list; the
    # repetition penalty reads its distinct ids, computed at the first step only.
    tokens = [5, 1, 5, 2, 7, 7]  # a prompt of 4, then 2 outputs
    view = PrefixView(tokens, 4)
    params = SamplingParams(repetition_penalty=1.5)
    as_view = SamplingRow(params, None, view, tokens[4:])
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(8)).repeat(2, 1)
    got = apply_penalties_to_rows(
        logits, [as_view, row(repetition_penalty=1.5, prompt=tokens[:4], output=tokens[4:])]
    )
    assert torch.equal(got[0], got[1]) and not torch.equal(got[0], logits[0])
    first = view.unique_ids()
    tokens.append(3)  # the request grows past its prompt
    assert view.unique_ids() is first and first.tolist() == [1, 2, 5]


def test_rows_with_penalties_filters_and_processors_sample_as_each_row_alone():
    # Every kind of row in one batch (sampled together) gives the token it gets alone:
    # penalised greedy and seeded random rows, filters, min_tokens, logit_bias, bad words.
    def rows():
        return [
            row(temperature=0.0, repetition_penalty=1.4, prompt=[0, 1], output=[2, 3]),
            row(seed=1, temperature=0.9, frequency_penalty=0.6, output=[4, 4, 5]),
            row(seed=2, temperature=1.1, top_k=4, presence_penalty=0.8, output=[6]),
            row(seed=3, temperature=0.8, top_p=0.7, repetition_penalty=0.9, prompt=[7]),
            row(temperature=0.0),
            row(seed=4, temperature=1.0, min_p=0.1),
            row(seed=5, temperature=1.0, min_tokens=3, stop_token_ids=[1], output=[2]),
            row(temperature=0.0, logit_bias={3: 5.0}, frequency_penalty=0.2, output=[3]),
            row(seed=6, temperature=0.7, bad_words_token_ids=[[2, 5]], output=[2]),
        ]

    for seed in range(10):
        logits = torch.randn(9, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
        together = sample(logits.clone(), rows())
        assert not together.errors
        alone = [sample(logits[[i]].clone(), [r]).token_ids[0] for i, r in enumerate(rows())]
        assert together.token_ids == alone
        got = sample_on_device(logits.clone(), rows())
        assert got[0].tolist() == alone and all(got[1].tolist()) and all(got[2].tolist())


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_row_that_fails_on_the_device_still_gets_a_token_id_in_range(bad):
    # With --async-scheduling the next step may already embed this token before the row's
    # failure reaches the host: an id past the vocabulary would crash it (on CUDA).
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[1, 2] = bad
    logits[3] = bad
    rows = [row(seed=i, temperature=1.0, top_p=0.9 if i % 2 else 1.0) for i in range(4)]
    tokens, logits_ok, ok = sample_on_device(logits, rows)
    assert logits_ok.tolist() == [True, False, True, False]
    assert all(0 <= t < VOCAB for t in tokens.tolist())
    greedy = sample_on_device(logits, [row(temperature=0.0)] * 2 + rows[2:])[0]
    assert all(0 <= t < VOCAB for t in greedy.tolist())


def test_logprobs_on_the_device_equal_those_of_sample():
    # --async-scheduling's logprobs: of the tokens still on the device, grouped by the
    # number of top logprobs; the same entries as sample() gives.
    def rows():
        return [
            row(temperature=0.0, logprobs=2),
            row(seed=1, temperature=0.9, logprobs=0),
            row(seed=2, temperature=1.0),
            row(temperature=0.0, logprobs=2, repetition_penalty=1.3, output=[1]),
            row(seed=3, temperature=0.7, top_k=3, logprobs=5),
        ]

    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    expected = sample(logits.clone(), rows())
    r = rows()
    tokens, _, _ = sample_on_device(logits, r)
    groups = sampled_logprobs_on_device(logits, r, tokens)
    assert sorted(i for idx, _, _ in groups for i in idx) == [0, 1, 3, 4]
    got = {}
    for idx, ints, floats in groups:
        ids = [tokens.tolist()[i] for i in idx]
        got.update(zip(idx, logprobs_from_host(ids, ints.tolist(), floats.tolist()), strict=True))
    assert [got.get(i) for i in range(5)] == expected.logprobs


# -- logprobs ------------------------------------------------------------------------------
def test_logprobs_are_raw_log_softmax_with_rank_and_sorted_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    tokens, lps, _ = sample(logits, [row(temperature=0.0, logprobs=3)])
    expected = logits[0].log_softmax(-1)
    lp = lps[0]
    assert tokens == [1]
    assert lp.token_id == 1
    assert lp.logprob == pytest.approx(float(expected[1]))
    assert lp.rank == 1
    assert [t for t, _ in lp.top] == [1, 2, 0]
    for t, v in lp.top:
        assert v == pytest.approx(float(expected[t]))


def test_logprobs_zero_gives_the_sampled_token_only():
    logits = torch.tensor([[0.0, 1.0]])
    _, lps, _ = sample(logits, [row(temperature=0.0, logprobs=0)])
    assert lps[0].top == []
    assert lps[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[1]))


def test_logprobs_of_a_random_sample_ignore_temperature_and_filters():
    # Sampled under top_k=2 and T=0.5, but reported against the raw distribution, with
    # the sampled token's 1-based rank in it.
    logits = torch.tensor([[2.0, 1.9, -5.0, 0.0]])
    raw = logits[0].log_softmax(-1)
    for seed in range(20):
        tokens, lps, _ = sample(logits, [row(seed=seed, temperature=0.5, top_k=2, logprobs=2)])
        t = tokens[0]
        assert t in (0, 1)
        assert lps[0].logprob == pytest.approx(float(raw[t]))
        assert lps[0].rank == t + 1  # token 0 is first, token 1 second
        assert [i for i, _ in lps[0].top] == [0, 1]


# -- a row that cannot be sampled fails alone (issue 16) -----------------------------------
def _unchecked(r: SamplingRow, **values) -> SamplingRow:
    """``r`` with values SamplingParams would refuse: the front end's checks missed them."""
    for name, value in values.items():
        object.__setattr__(r.params, name, value)
    return r


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_fail_their_row_only(bad):
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 0.0, 0.0], [3.0, 0.0, 1.0]])
    logits[1, 1] = bad
    rows = [row(temperature=0.0, logprobs=1), row(temperature=0.0, logprobs=1), row(seed=3)]
    alone = sample(logits[[0, 2]].clone(), [row(temperature=0.0, logprobs=1), row(seed=3)])
    tokens, lps, errors = sample(logits, rows)
    assert tokens[1] is None and lps[1] is None
    assert set(errors) == {1} and errors[1].internal  # the model's fault: a 500
    # The other rows are what they would have been without the bad one (same seed).
    assert [tokens[0], tokens[2]] == alone.token_ids
    assert lps[0] == alone.logprobs[0]


def test_all_masked_logits_fail_the_row():
    logits = torch.full((1, 4), float("-inf"))
    _, _, errors = sample(logits, [row(temperature=0.0)])
    assert set(errors) == {0}


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 1},
        {"temperature": 0.0, "logit_bias": {2: 0.5}},  # penalised in the processors' copy
    ],
)
def test_penalties_that_overflow_fail_the_row_as_the_request_s_fault(params):
    # A repetition penalty of 1e-300 divides positive logits into inf: the probabilities
    # are NaN. Issue 16: this ended the engine process.
    logits = torch.tensor([[2.0, 1.0, -1.0], [2.0, 1.0, -1.0]])
    bad = _unchecked(row(prompt=[0, 1], **params), repetition_penalty=1e-300)
    tokens, _, errors = sample(logits, [bad, row(temperature=0.0)])
    assert tokens == [None, 0]
    assert set(errors) == {0} and not errors[0].internal  # the request's values: a 400
    assert "sampling parameters" in errors[0].message


def test_an_exception_while_sampling_a_row_fails_that_row_only():
    logits = torch.tensor([[2.0, 1.0], [0.0, 5.0]])
    broken = row(temperature=1.0)
    broken.generator = "not a generator"  # torch.multinomial raises TypeError
    tokens, _, errors = sample(logits, [broken, row(temperature=0.0)])
    assert tokens == [None, 1]
    assert set(errors) == {0} and errors[0].internal and "TypeError" in errors[0].message


# -- prompt logprobs -----------------------------------------------------------------------
def test_token_logprobs_per_row_of_given_tokens_with_rank_and_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    rows = token_logprobs(logits, [2, 3], 2)
    expected = logits.log_softmax(-1)
    assert [r.token_id for r in rows] == [2, 3]
    assert rows[0].logprob == pytest.approx(float(expected[0, 2])) and rows[0].rank == 2
    assert rows[1].logprob == pytest.approx(float(expected[1, 3])) and rows[1].rank == 2
    assert [t for t, _ in rows[0].top] == [1, 2] and [t for t, _ in rows[1].top] == [2, 3]
    assert rows[1].top[0][1] == pytest.approx(float(expected[1, 2]))
    assert token_logprobs(logits, [1, 2], 0)[0].top == []


# -- the draw itself ------------------------------------------------------------------------
def test_draw_follows_the_distribution_and_never_picks_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.2, 0.0, 0.2, 0.1, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20_000
    counts = Counter(draw(probs, g) for _ in range(n))
    assert set(counts) == {1, 2, 4, 5}
    for token, p in enumerate(probs.tolist()):
        # 4 standard deviations of a binomial count: a wrong sampler misses by far more.
        assert abs(counts[token] / n - p) <= 4 * math.sqrt(p * (1 - p) / n) + 1e-9, token


def test_draw_is_reproducible_per_generator():
    probs = torch.randn(49152, generator=torch.Generator().manual_seed(1)).softmax(-1)
    a = [draw(probs, torch.Generator().manual_seed(7)) for _ in range(3)]
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert [draw(probs, g1) for _ in range(5)] == [draw(probs, g2) for _ in range(5)]
    assert len(set(a)) == 1


@pytest.mark.parametrize("u,expected", [(0.0, 1), (1.0, 4)])
def test_draw_at_the_ends_of_the_unit_interval_picks_tokens_with_mass(monkeypatch, u, expected):
    # u = 0 must skip leading zero-mass tokens; u * total rounding up to the total must not
    # fall past the last token with mass (into the zero tail).
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(u, dtype=torch.float64))
    assert draw(torch.tensor([0.0, 0.3, 0.0, 0.3, 0.4, 0.0, 0.0])) == expected


# -- rows with only a temperature, sampled together ------------------------------------------
def test_temperature_rows_sampled_together_equal_row_by_row():
    logits = torch.randn(16, 49152, generator=torch.Generator().manual_seed(2)) * 3
    temps = [0.3, 0.7, 1.0, 1.5] * 4
    rows = [row(seed=100 + i, temperature=t) for i, t in enumerate(temps)]
    together = sample(logits.clone(), rows).token_ids
    one_by_one = [
        draw(filter_logits(logits[i].clone(), rows[i].params).softmax(-1),
             torch.Generator().manual_seed(100 + i))
        for i in range(16)
    ]  # fmt: skip
    assert together == one_by_one
    assert len(set(together)) > 8  # a real draw, not a constant


@pytest.mark.parametrize("with_greedy", [False, True])
def test_a_temperature_row_that_overflows_fails_alone_among_batched_rows(with_greedy):
    logits = torch.zeros(4, 64)
    logits[1, 5] = 3e38  # / 0.5 = inf: the tempered logits are not finite
    logits[3, 9] = 1.0
    rows = [row(seed=1, temperature=1.0), row(seed=2, temperature=0.5), row(seed=3)]
    others = [row(seed=1, temperature=1.0), row(seed=3)]
    if with_greedy:  # the random rows are drawn apart from the argmax of the greedy one
        rows.append(row(temperature=0.0))
        others.append(row(temperature=0.0))
    tokens, _, errors = sample(logits[: len(rows)], rows)
    alone = sample(logits[[0, 2, 3][: len(others)]].clone(), others)
    assert tokens[1] is None and set(errors) == {1} and not errors[1].internal
    assert [t for i, t in enumerate(tokens) if i != 1] == alone.token_ids


def test_batched_rows_fall_back_to_one_by_one_when_the_batch_raises():
    logits = torch.tensor([[2.0, 1.0], [0.0, 5.0], [1.0, 1.0]])
    broken = [row(temperature=1.0), row(temperature=1.0)]
    for r in broken:
        r.generator = "not a generator"
    tokens, _, errors = sample(logits, [broken[0], row(seed=4, temperature=1.0), broken[1]])
    assert tokens[0] is None and tokens[2] is None and set(errors) == {0, 2}
    assert tokens[1] == sample(logits[[1]].clone(), [row(seed=4, temperature=1.0)]).token_ids[0]


# -- min_tokens ------------------------------------------------------------------------------
def _stopping(min_tokens: int, output: list[int], **params) -> SamplingRow:
    r = row(min_tokens=min_tokens, output=output, stop_token_ids=[5], **params)
    r.params.update_from_generation_config(7, {6})  # EOS 7, another listed EOS 6
    return r


def test_stop_tokens_cannot_be_sampled_before_min_tokens():
    # Tokens 5, 6 and 7 stop; they are the three most likely.
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.2, 0.1, 9.0, 8.0, 7.0]])
    before = logits.clone()
    early = _stopping(3, [1, 2], temperature=0.0)
    assert sample(logits, [early]).token_ids == [1]
    assert torch.equal(logits, before)  # masked in a copy
    assert sample(logits, [_stopping(3, [1, 2, 3], temperature=0.0)]).token_ids == [5]
    # Random rows too (batched and one by one), however likely the stops are.
    tempered = draws(logits[0], 200, min_tokens=2, stop_token_ids=[5, 6, 7], temperature=1.0)
    assert set(tempered) <= {0, 1, 2, 3, 4}
    filtered = draws(
        logits[0], 200, min_tokens=2, stop_token_ids=[5, 6, 7], temperature=1.0, top_k=4
    )
    assert set(filtered) <= {1, 2, 3, 4}  # the top 4 once the stops are masked


def test_min_tokens_mask_ignores_ids_outside_the_vocabulary_and_other_rows():
    logits = torch.tensor([[0.0] * 7 + [1.0], [0.0] * 7 + [1.0]])
    short = row(min_tokens=4, stop_token_ids=[7, 100], temperature=0.0)
    assert sample(logits, [short, row(temperature=0.0)]).token_ids == [0, 7]


# -- allowed_token_ids and logit_bias ---------------------------------------------------------
def test_allowed_token_ids_restrict_every_kind_of_row():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]] * 3)
    rows = [
        row(temperature=0.0, allowed_token_ids=[6, 3]),
        row(temperature=0.0),  # unrestricted beside it
        # The penalised path (row by row): token 0 is penalised and masked anyway.
        row(temperature=0.0, repetition_penalty=1.5, prompt=[0], allowed_token_ids=[6, 3]),
    ]
    assert sample(logits, rows).token_ids == [3, 0, 3]
    tempered = draws(logits[0], 200, temperature=1.0, allowed_token_ids=[2, 7])
    assert set(tempered) == {2, 7}


def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    out = sample(logits, [row(temperature=0.0, logit_bias={7: 100.0, 0: -100.0}, logprobs=1)])
    assert out.token_ids == [7]
    raw = torch.log_softmax(logits[0], -1)
    assert out.logprobs[0].logprob == pytest.approx(float(raw[7]))  # the model's logprob
    assert sample(logits, [row(temperature=0.0, logit_bias={1: 1.5})]).token_ids == [1]
    banned = draws(logits[0], 200, temperature=1.0, logit_bias={0: -100.0, 1: -100.0})
    assert not set(banned) & {0, 1}


def test_bad_words_ban_the_token_that_would_complete_one():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 7.0, 0.5, 0.2]] * 2)
    words = [[3], [4, 5], [6, 2, 1]]  # one token; two; three

    def banned(output: list[int]) -> int:
        r = row(temperature=0.0, output=output)
        r.params.bad_words_token_ids = words
        return sample(logits[:1], [r]).token_ids[0]

    assert banned([0]) == 4  # 3 always; 4 starts a word but does not complete one
    assert banned([7, 4]) == 4  # after 4: 5 would complete [4, 5], 4 would not
    strong_one = torch.tensor([[0.0, 9.5, 2.0, 9.0, 8.0, 7.0, 0.5, 0.2]])
    r = row(temperature=0.0, output=[6, 2])
    r.params.bad_words_token_ids = words
    assert sample(strong_one, [r]).token_ids == [4]  # 1 completes [6, 2, 1]; 3 banned
    r.params.bad_words_token_ids = []
    assert sample(strong_one, [r]).token_ids == [1]


# -- thinking_token_budget ----------------------------------------------------------------
def _greedy_run(r: SamplingRow, steps: int, favourite: int = 1) -> list[int]:
    """``steps`` greedy tokens of ``r`` over logits that always prefer ``favourite``."""
    logits = torch.zeros(1, VOCAB)
    logits[0, favourite] = 5.0
    for _ in range(steps):
        r.output_token_ids.append(sample(logits.clone(), [r]).token_ids[0])
    return r.output_token_ids


def test_a_spent_thinking_budget_forces_the_end_sequence_then_lets_go():
    r = row(temperature=0, thinking_token_budget=3, thinking_end_token_ids=[[6, 7], [5]])
    # 3 tokens of reasoning, then the end sequence 6 7, then the model's own choice again.
    assert _greedy_run(r, 8) == [1, 1, 1, 6, 7, 1, 1, 1]


def test_an_end_sequence_already_begun_is_completed_and_any_end_counts():
    r = row(temperature=0, thinking_token_budget=2, thinking_end_token_ids=[[6, 7, 4]])
    r.output_token_ids.extend([1, 1, 6])  # the model began the end itself at the budget
    assert _greedy_run(r, 3) == [1, 1, 6, 7, 4, 1]
    # An alternative end (Qwen3's <tool_call>) before the budget: nothing is forced.
    r = row(temperature=0, thinking_token_budget=4, thinking_end_token_ids=[[6, 7], [5]])
    r.output_token_ids.extend([1, 5])
    assert _greedy_run(r, 6)[2:] == [1] * 6
    # A budget of 0: the reasoning ends at once.
    r = row(temperature=0, thinking_token_budget=0, thinking_end_token_ids=[[6]])
    assert _greedy_run(r, 2) == [6, 1]


def test_a_thinking_budget_holds_for_sampled_rows_in_a_mixed_batch():
    budget = row(seed=3, temperature=1.0, thinking_token_budget=1, thinking_end_token_ids=[[7]])
    free = row(temperature=0)
    budget.output_token_ids.append(2)
    logits = torch.zeros(2, VOCAB)
    logits[:, 0] = 3.0
    tokens = sample(logits, [budget, free]).token_ids
    assert tokens == [7, 0]


@pytest.mark.parametrize("value", [-2, 1.5, "3", True])
def test_a_bad_thinking_budget_names_itself(value):
    with pytest.raises(ValueError, match="thinking_token_budget") as e:
        SamplingParams(thinking_token_budget=value)
    assert e.value.param == "thinking_token_budget"
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None


def test_bare_rows_sampled_on_the_device_equal_sample():
    # --async-scheduling's sampler: greedy rows and random ones with their filters, drawn
    # with their own generators in row order, give sample()'s tokens (which filters and
    # draws row by row); a non-finite row is flagged.
    torch.manual_seed(3)

    def rows():
        return [
            row(temperature=0.0, top_p=0.5),  # greedy: the filters change nothing
            row(seed=1, temperature=0.7),
            row(seed=2, temperature=1.3, top_k=3),
            row(seed=4, temperature=0.9),
            row(seed=5, temperature=1.0, top_p=0.8),
            row(seed=6, temperature=1.2, min_p=0.2),
            row(seed=7, temperature=0.8, top_k=4, top_p=0.7, min_p=0.05),
            row(seed=8, temperature=1.0, top_k=VOCAB),  # k = vocabulary: no mask
        ]

    ok = [i for i in range(8) if i != 3]
    for _ in range(20):
        logits = torch.randn(8, VOCAB) * 3
        logits[3] = float("nan")
        expected = sample(logits.clone(), rows())
        tokens, logits_ok, ok = sample_on_device(logits.clone(), rows())
        assert logits_ok.tolist() == [i != 3 for i in range(8)]
        got = tokens.tolist()
        assert [got[i] for i in ok] == [expected.token_ids[i] for i in ok]
        assert expected.token_ids[3] is None


def test_bare_means_the_logits_and_the_generator_alone():
    assert is_bare(SamplingParams(temperature=0.0))
    assert is_bare(SamplingParams(temperature=0.8, seed=1))
    assert is_bare(SamplingParams(temperature=0.8, top_p=0.9, top_k=5, min_p=0.1))
    assert is_bare(SamplingParams(temperature=0.0, logprobs=1))  # of the logits alone too
    for params in (
        dict(temperature=0.0, repetition_penalty=1.2),
        dict(temperature=0.8, frequency_penalty=0.5),
        dict(temperature=0.8, presence_penalty=0.5),
        dict(temperature=0.0, min_tokens=2),
        dict(temperature=0.0, logit_bias={1: 2.0}),
    ):
        assert not is_bare(SamplingParams(**params)), params


def test_top_p_method_is_chosen_by_name_and_a_bad_one_refused(monkeypatch):
    x, top_p = _nucleus_rows(300)
    x, top_p = x[:-1], top_p[:-1]  # no NaN row
    by_sort = apply_top_p(x, top_p, method="sort")
    # triton takes CUDA rows only (or the interpreter's): here the sort's mask.
    assert torch.equal(apply_top_p(x, top_p, method="triton"), by_sort)
    for name in ("numpy", "sort", "triton", "auto"):
        monkeypatch.setenv("VLLM_TOP_P_METHOD", name)
        assert torch.equal(apply_top_p(x, top_p), by_sort)
    with pytest.raises(ValueError, match="method must be one of numpy, sort, triton"):
        apply_top_p(x, top_p, method="bisect")
    monkeypatch.setenv("VLLM_TOP_P_METHOD", "bisect")
    with pytest.raises(ValueError, match="VLLM_TOP_P_METHOD='bisect'"):
        apply_top_p(x, top_p)


def test_finite_and_argmax_flags_each_row_and_takes_the_first_maximum():
    from vllm.v1.sample.sampler import finite_and_argmax

    inf, nan = float("inf"), float("nan")
    raw = torch.tensor(
        [
            [0.5, 2.0, 2.0, -1.0],  # a tie: the first maximum, as argmax
            [0.0, nan, 1.0, 3.0],
            [inf, 0.0, 1.0, 2.0],
            [-inf, -inf, -inf, -inf],
            [-inf, -3.0, -inf, -5.0],  # -inf entries beside finite ones are fine
        ]
    )
    finite, argmax = finite_and_argmax(raw, list(range(5)))
    assert finite == [True, False, False, False, True]
    assert argmax[0] == 1 and argmax[4] == 1
    assert finite_and_argmax(raw, [0, 4]) == (finite, [1, 1])
    assert finite_and_argmax(raw, []) == (finite, [])
