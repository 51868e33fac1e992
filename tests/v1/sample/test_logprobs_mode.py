"""vLLM's --logprobs-mode: raw_logprobs (the default), raw_logits, processed_logprobs and
processed_logits, against values computed here from the logits."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.sampler import SamplingRow, sample

VOCAB = 50


def _logits(rows: int = 2) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(3)) * 2


def _row(seed=None, output=(), **params) -> SamplingRow:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(SamplingParams(seed=seed, logprobs=4, **params), gen, [1, 2], list(output))


def test_raw_modes_report_the_models_logprobs_or_logits():
    logits = _logits()

    def rows():  # fresh generators: the same draws in both calls
        return [_row(temperature=0.0), _row(seed=1, temperature=0.7, top_k=5)]

    raw = sample(logits.clone(), rows(), logprobs_mode="raw_logprobs")
    as_logits = sample(logits.clone(), rows(), logprobs_mode="raw_logits")
    assert raw.token_ids == as_logits.token_ids
    lp = logits.log_softmax(-1)
    for i, (a, b) in enumerate(zip(raw.logprobs, as_logits.logprobs, strict=True)):
        token = raw.token_ids[i]
        assert a.logprob == pytest.approx(lp[i, token].item(), abs=1e-5)
        assert b.logprob == pytest.approx(logits[i, token].item(), abs=1e-5)
        assert a.rank == b.rank  # the same order either way
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_processed_modes_report_what_the_token_was_drawn_from():
    logits = _logits()
    greedy = _row(temperature=0.0, output=[int(logits[0].argmax())], repetition_penalty=2.0)
    drawn = _row(seed=2, temperature=0.5, top_k=3)
    out = sample(logits.clone(), [greedy, drawn], logprobs_mode="processed_logprobs")
    # The greedy row: after its penalty (no temperature).
    x = logits[0].clone()
    seen = torch.tensor([1, 2, *greedy.output_token_ids])
    x[seen] = torch.where(x[seen] > 0, x[seen] / 2.0, x[seen] * 2.0)
    token = out.token_ids[0]
    assert token == int(x.argmax())
    assert out.logprobs[0].logprob == pytest.approx(x.log_softmax(-1)[token].item(), abs=1e-5)

    # The sampled row: temperature, then only its top 3 are left (their logprobs sum to 1).
    def finite(entry) -> dict[int, float]:
        return {t: v for t, v in entry.top if math.isfinite(v)}

    top = finite(out.logprobs[1])  # 4 asked: the 4th is filtered out (-inf)
    assert len(out.logprobs[1].top) == 4 and len(top) == 3
    assert sum(math.exp(v) for v in top.values()) == pytest.approx(1.0)
    scaled = (logits[1] / 0.5).topk(3)
    kept = scaled.values.log_softmax(-1)
    assert top == pytest.approx(dict(zip(scaled.indices.tolist(), kept.tolist(), strict=True)))
    as_logits = sample(logits.clone(), [greedy, _row(seed=2, temperature=0.5, top_k=3)],
                       logprobs_mode="processed_logits").logprobs[1]  # fmt: skip
    assert finite(as_logits) == pytest.approx(
        dict(zip(scaled.indices.tolist(), scaled.values.tolist(), strict=True))
    )


def test_the_mode_is_checked_and_processed_modes_refuse_drafts():
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        EngineArgs(logprobs_mode="processed").create_engine_config()
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    with pytest.raises(ValueError, match="processed_\\* cannot be combined"):
        EngineArgs(
            logprobs_mode="processed_logprobs", speculative_config=spec
        ).create_engine_config()


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_reports_processed_logprobs(tmp_path, async_scheduling):
    from tests.entrypoints.test_generation_config import tiny_model
    from vllm import LLM

    model = tiny_model(tmp_path / "tiny")
    llm = LLM(model=model, kv_cache_memory="16MiB", logprobs_mode="processed_logprobs",
              async_scheduling=async_scheduling)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=4, temperature=0.7, top_k=5, seed=0, logprobs=5)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0].outputs[0]
        for entry in out.logprobs:  # only the top 5 survive: their probabilities sum to 1
            assert sum(math.exp(v) for _, v in entry.top) == pytest.approx(1.0, abs=1e-4)
            assert entry.rank <= 5 and math.isfinite(entry.logprob)
    finally:
        llm.shutdown()
