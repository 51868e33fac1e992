"""Beam search: the pure step (``BeamSet``), then ``LLM.beam_search`` on a tiny model.
The server's ``use_beam_search`` is tested end to end in openai/test_server.py."""

from __future__ import annotations

import math

import pytest

from vllm.entrypoints.openai.beam_search import Beam, BeamSet, score
from vllm.sampling_params import BeamSearchParams, SamplingParams

EOS = 2


def test_a_step_keeps_the_best_and_sets_ended_beams_aside():
    search = BeamSet([5, 6], width=2, eos_ids=[EOS], ignore_eos=False, length_penalty=1.0)
    assert search.prompts() == [[5, 6]] and search.params().logprobs == 4
    assert search.grow([[(7, -0.1), (EOS, -0.2), (8, -1.0), (9, -3.0)]])
    assert [b.tokens for b in search.beams] == [[7], [8]]
    assert [b.tokens for b in search.ended] == [[EOS]]
    assert search.prompts() == [[5, 6, 7], [5, 6, 8]]
    search.grow([[(10, -0.5), (11, -2.0)], [(12, -0.1), (13, -0.2)]])
    # Scores divide by the length (prompt included, EOS not): 2 + 2 tokens live, 2 ended.
    assert [b.tokens for b in search.beams] == [[7, 10], [8, 12]]
    best = search.best()
    assert [b.tokens for b in best] == [[EOS], [7, 10]]  # -0.2 / 2 beats -0.6 / 4
    assert best[0].ended and math.isclose(score(best[1], 2, 1.0), -0.6 / 4)
    # Without EOS handling a beam that reached it goes on like any other.
    free = BeamSet([5], width=1, eos_ids=[EOS], ignore_eos=True, length_penalty=1.0)
    free.grow([[(EOS, -0.1), (3, -0.2)]])
    assert [b.tokens for b in free.beams] == [[EOS]] and not free.ended


def test_length_penalty_favours_longer_beams_above_one():
    short, long = Beam([1], -1.0), Beam([1, 2, 3], -1.5)
    assert score(short, 1, 1.0) < score(long, 1, 1.0)  # -0.5 vs -0.375
    assert score(short, 1, 0.0) > score(long, 1, 0.0)  # plain cumulative logprob


def test_params_refuse_what_beam_search_does_not_do():
    for fields, name in (
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": 0.5}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
    ):
        with pytest.raises(ValueError, match=name):
            BeamSearchParams(**fields)


@pytest.mark.slow
def test_llm_beam_search(tmp_path):
    from tests.entrypoints.test_generation_config import tiny_model
    from vllm import LLM

    llm = LLM(model=tiny_model(tmp_path / "tiny"), max_model_len=128, num_gpu_blocks_override=64)
    prompt = [10, 20, 30, 40]
    greedy = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
    )[0].outputs[0]
    one = llm.beam_search(
        {"prompt_token_ids": prompt},
        BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True),
    )[0].sequences
    assert len(one) == 1 and one[0].tokens == prompt + list(greedy.token_ids)
    outputs = llm.beam_search(
        [{"prompt_token_ids": prompt}, "Hello there"],
        BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True),
    )
    assert len(outputs) == 2
    for out in outputs:
        seqs = out.sequences
        assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
        scores = [s.cum_logprob / len(s.tokens) for s in seqs]  # length: prompt + 5 each
        assert scores == sorted(scores, reverse=True) and all(
            s.finish_reason == "length" for s in seqs
        )
    with pytest.raises(ValueError, match="params"):
        llm.beam_search("Hi", SamplingParams())
