"""Qwen3.5's Gated DeltaNet layers on CUDA: the recurrent states' pools and checkpoints on
the device, the batched decode's gathers and scatters by slot, the chunked delta rule's
triangular solves, in the engine. fp32: greedy tokens equal transformers' (CPU, fp32) in
16-token chunks, mixed batches, a job's next turn restored from a checkpoint, and one
restored from the CPU KV tier's host slots (blocks loaded, states copied host to device),
drafts verified with the states rolled back to those kept; bf16
(the CUDA default, states in bf16 by --mamba-ssm-cache-dtype auto): the same run
completes and its first tokens mostly agree. The CPU tests of the same paths are
tests/v1/engine/test_recurrent_engine.py and tests/model_executor/test_qwen3_next.py.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import hf_greedy
from tests.v1.engine.test_recurrent_engine import (  # noqa: F401 (fixture)
    _prompts,
    check_offloaded_turn,
    check_oracle_drafts,
    qwen35,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _turns(path, dtype: str, max_tokens: int = 12):
    """Four prompts at once, then a job's next turn; (tokens of each, the next turn's
    tokens, its cached tokens)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(path), dtype=dtype, kv_cache_memory="64MiB", max_num_batched_tokens=16,
              enforce_eager=True)  # fmt: skip
    try:
        assert llm.engine_core.model_runner.device.type == "cuda"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts = _prompts(4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        second = prompts[2] + tokens[2] + _prompts(1, seed=9)[0]
        again = llm.generate({"prompt_token_ids": second}, params)[0]
        return prompts, tokens, second, list(again.outputs[0].token_ids), again.num_cached_tokens
    finally:
        llm.shutdown()


def test_fp32_matches_transformers(qwen35):  # noqa: F811
    path, hf = qwen35
    prompts, tokens, second, again, cached = _turns(path, "float32")
    assert tokens == hf_greedy(hf, prompts, 12)
    assert cached > 0 and cached % 16 == 0
    assert again == hf_greedy(hf, [second], 12)[0]


def test_bf16_runs_and_mostly_agrees(qwen35):  # noqa: F811
    path, hf = qwen35
    prompts, tokens, _, again, cached = _turns(path, "bfloat16", max_tokens=4)
    want = hf_greedy(hf, prompts, 4)
    pairs = [(a, b) for t, w in zip(tokens, want, strict=True) for a, b in zip(t, w, strict=True)]
    agree = sum(a == b for a, b in pairs)
    assert agree >= 0.75 * sum(map(len, want)) and len(again) == 4 and cached > 0


def test_a_turn_comes_back_from_the_cpu_tier(qwen35):  # noqa: F811
    """The host checkpoint slots' copies cross the host link both ways (device to host on
    eviction, host to the request's device slot on a hit); fp32, transformers' tokens."""
    check_offloaded_turn(*qwen35, dtype="float32", enforce_eager=True)


def test_drafts_roll_the_states_back(qwen35, monkeypatch):  # noqa: F811
    """Drafts verified a position at a time, the states after each kept on the device and
    the slot rolled back to the drafts kept; fp32, transformers' tokens."""
    check_oracle_drafts(*qwen35, monkeypatch, dtype="float32", enforce_eager=True)
