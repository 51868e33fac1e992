"""The whole model's accuracy with the approximate decode activations (int8 on AVX512-VNNI,
bf16 on AMX) against the fp32 model: logits at every position, perplexity, and greedy
outputs, each activation type with its own measured bounds (slow).

Bounds from measurements on the fixed inputs, with a margin (docs/kernels.md). The text
is the start of docs/design.md as it was then, frozen in data/perplexity_text.md (the
live file drifted: test_gguf_quantization.ACCURACY_TEXT):
- int8: 256 positions of that text, 16 a forward, gave max |logit diff| 3.8 and top-1
  240/256; perplexity on 512 tokens 107.02 against fp32's 107.22 (107.85 on a
  Sapphire Rapids-class Xeon with AMX, session 23: +0.58%); greedy 24 tokens, 6/8
  outputs identical with SDPA as the prefill attention, 3/8 with the native prefill kernel
  (top-1 then 244/256): the prompts' hidden states move by float rounding (<= 8e-5), and
  int8 decode's near-ties flip on that.
- bf16: max |logit diff| 1.95-2.0, top-1 252-255/256; perplexity 107.19-107.22; greedy
  identical on 5/8.
Greedy identity over 24 tokens is a coarse signal for a path with a few % top-1
disagreement; the logits and perplexity bounds are the accuracy checks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from tests.kernels.test_quant_kernels import cpu_has_avx512_vnni
from tests.model_executor.test_gguf_quantization import (
    PROMPTS,
    decode_act_vs_fp32,
    gguf_perplexities,
    greedy_same_as_fp32,
)
from vllm.model_executor.layers.quantization import gguf

TOKENS_PER_STEP = 16  # as 16 concurrent decode streams: these kernels' target batch


@dataclass(frozen=True)
class Bounds:
    has_cpu: Callable[[], bool]  # the CPU runs this path (else the layers run fp32)
    max_logit_diff: float
    min_top1: float
    min_greedy_identical: int  # of 8
    ppl_tolerance: float  # |ppl / ppl_fp32 - 1|


BOUNDS = {
    "int8": Bounds(cpu_has_avx512_vnni, 6.0, 0.9, 2, 1e-2),
    "bf16": Bounds(gguf.cpu_has_amx_bf16, 4.0, 0.93, 3, 5e-3),
}


@pytest.fixture(params=list(BOUNDS))
def act(request) -> str:
    if not BOUNDS[request.param].has_cpu():
        pytest.skip(f"{request.param} decode: this CPU lacks its instructions")
    return request.param


@pytest.mark.slow
def test_decode_logits_agree_with_fp32(monkeypatch, act):
    diff, top1 = decode_act_vs_fp32(monkeypatch, act, TOKENS_PER_STEP)
    assert 0 < diff < BOUNDS[act].max_logit_diff  # > 0: the approximate path really ran
    assert top1 >= BOUNDS[act].min_top1


@pytest.mark.slow
def test_decode_perplexity(monkeypatch, act):
    monkeypatch.setenv("VLLM_CPU_GGUF_DECODE_ACT", act)
    ppl = gguf_perplexities(TOKENS_PER_STEP)
    assert abs(ppl["gguf"] / ppl["fp32"] - 1) < BOUNDS[act].ppl_tolerance
    assert ppl["gguf"] != ppl["fp32"]  # the approximate path really ran


@pytest.mark.slow
def test_decode_greedy_outputs(monkeypatch, act):
    # The prefill stays fp32 (exact) so the outputs differ by the decode steps alone; the
    # 8 prompts decode together: every decode step is an 8-row forward.
    monkeypatch.setenv("VLLM_CPU_GGUF_PREFILL_DTYPE", "fp32")
    same = greedy_same_as_fp32(monkeypatch, {"VLLM_CPU_GGUF_DECODE_ACT": act})
    print(f"{act} decode: greedy outputs identical on {same}/{len(PROMPTS)} prompts")
    assert same >= BOUNDS[act].min_greedy_identical
