"""Draft-model speculative decoding on CUDA with CUDA graphs: a bf16 engine whose target
and draft are random models of the embedded model's shape (SmolLM2-135M's config, its
vocabulary; the weights cannot travel to the GPU machine, random ones are built there in
seconds). The target's decode steps and the draft's single-token steps replay graphs
(counted); the greedy tokens are plain decoding's.

"Plain decoding's" in bf16: a step with drafts computes k + 1 rows where plain decoding
computes one, so its GEMMs round differently, and random weights give near-ties that such
rounding turns. Each generated token is therefore checked against the target's own
distribution at its position (plain engine, teacher-forced: ``prompt_logprobs``): the
argmax, or within ``TIE`` nats of it (how many equal plain decoding's is in the message). A
wrong KV slot, a stale draft fed or a graph replaying another step's buffers gives
tokens far from the argmax, which this fails on.

Run with ``pytest -m cuda tests/cuda/test_draft_model_cuda.py`` on a CUDA machine with
triton; skipped without one. The same plumbing runs on the CPU with stand-in graphs in
tests/v1/spec_decode/test_draft_model_graphs.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.utils import save_smollm_vocab_llama
from vllm.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

# SmolLM2-135M-Instruct's shape (the embedded model's config).
SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0,
    max_position_embeddings=2048,
)  # fmt: skip
TIE = 0.1  # nats: a bf16 near-tie, well under the gap a wrong context gives
PROMPTS = [[300 + t for t in range(12)] * 3, [7, 8, 9] * 10, list(range(1000, 1050))]


def teacher_forced_margins(plain, prompts, outputs) -> list[list[float]]:
    """For each generated token: the target's top logprob at its position minus the
    token's (0 where it is the argmax), from ``plain`` over prompt + output."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)
    full = [{"prompt_token_ids": p + o} for p, o in zip(prompts, outputs, strict=True)]
    margins = []
    for p, o, res in zip(prompts, outputs, plain.generate(full, params), strict=True):
        entries = res.prompt_logprobs[len(p) : len(p) + len(o)]
        margins.append([max(e.top[0][1] - e.logprob, 0.0) for e in entries])
    return margins


def test_greedy_bf16_with_draft_graphs_is_plain_decoding(tmp_path):
    from vllm import LLM

    save_smollm_vocab_llama(tmp_path, **SMOLLM2_135M)
    # 16 sequences: a step of 3 requests with 4 drafts each (15 rows) replays too. A
    # fixed KV size: both engines live at once (the plain one checks the other's tokens).
    kwargs = dict(model=str(tmp_path), dtype="bfloat16", max_model_len=512, max_num_seqs=16,
                  kv_cache_memory="1GiB")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(**kwargs)
    try:
        base = [list(o.outputs[0].token_ids) for o in plain.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params)]  # fmt: skip
        spec = LLM(
            **kwargs, speculative_config={"model": str(tmp_path), "num_speculative_tokens": 4}
        )
        try:
            runner = spec.engine_core.model_runner
            assert runner.decode_graphs is not None and runner.drafter.graphs is not None
            assert runner.drafter.graphs.sizes == runner.decode_graphs.sizes
            got = [list(o.outputs[0].token_ids) for o in spec.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], params)]  # fmt: skip
            target_replays = runner.decode_graphs.num_replays
            draft_replays = runner.drafter.graphs.num_replays
            spec.engine_core.scheduler.check_invariants()
        finally:
            spec.shutdown()
        margins = teacher_forced_margins(plain, PROMPTS, got)
    finally:
        plain.shutdown()
    assert all(len(o) == 48 for o in got)
    same = sum(a == b for g, b_ in zip(got, base, strict=True) for a, b in zip(g, b_, strict=True))
    worst = max(max(m) for m in margins)
    assert worst <= TIE, (worst, f"{same}/{sum(map(len, base))} equal to plain", margins)
    # Every decode step replays the target's step (at most 15 rows) and the draft's
    # k - 1 = 3 single-token forwards (and its catch-up, after a decode step).
    assert target_replays >= 8 and draft_replays >= 2 * target_replays, (
        target_replays,
        draft_replays,
    )
