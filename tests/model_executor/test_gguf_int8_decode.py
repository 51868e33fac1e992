"""The gguf path's int8 decode activations: the VLLM_CPU_GGUF_DECODE_ACT switch, which forwards
take it, and the whole model's logits, perplexity and greedy outputs against fp32 (slow).

int8 rounds each 32-value block of a row to 255 levels (dx = amax / 127): each input is off by
at most dx / 2, so a dot product by at most sum(|w| * dx / 2); the kernel tests hold it to that
bound (tests/kernels/test_quant_kernels.py). Here: what that does to the model.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_quant_kernels import cpu_has_avx512_vnni, random_blocks
from tests.model_executor.test_gguf_quantization import (
    PROMPTS,
    decode_act_vs_fp32,
    gguf_perplexities,
    greedy_same_as_fp32,
)
from vllm import _custom_ops as ops
from vllm import envs
from vllm.model_executor.layers.quantization import gguf

VAR = "VLLM_CPU_GGUF_DECODE_ACT"
needs_vnni = pytest.mark.skipif(not cpu_has_avx512_vnni(), reason="int8 path needs AVX512-VNNI")


# -- the switch -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw,expected", [(None, "auto"), ("", "auto"), ("INT8", "int8"), ("fp32", "fp32")]
)
def test_switch_parses(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, raw)
    assert envs.VLLM_CPU_GGUF_DECODE_ACT == expected
    if expected != "auto":  # auto: tests/model_executor/test_gguf_bf16_decode.py
        assert gguf.decode_act() == expected


@pytest.mark.parametrize("bad", ["int4", "fp16", "1"])
def test_bad_switch_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(VAR, bad)
    with pytest.raises(ValueError, match=VAR):
        gguf.decode_act()


def test_bad_decode_act_is_refused():
    w_q = random_blocks(8, 64, ops.GGML_Q4_1)
    with pytest.raises(ValueError, match="decode_act"):
        ops.ggml_linear(torch.randn(8, 64), w_q, ops.GGML_Q4_1, 48, torch.float32, "int4")
    with pytest.raises(ValueError, match="decode_act"):
        gguf.GGUFLinear(w_q, ops.GGML_Q4_1, None, decode_act="fp16")


# -- which forwards take it -------------------------------------------------------------------
@needs_vnni
@pytest.mark.parametrize("tokens", [5, 16, 47])
def test_decode_rows_take_int8(tokens):
    w_q = random_blocks(96, 64, ops.GGML_Q4_1)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3))
    int8 = ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32, "int8")
    assert not torch.equal(int8, ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32))
    layer = gguf.GGUFLinear(w_q, ops.GGML_Q4_1, None, decode_act="int8")
    assert torch.equal(layer(x), int8)


@pytest.mark.parametrize("tokens", [1, 4, 48, 64])
def test_small_and_prefill_batches_stay_fp32(tokens):
    # 1-4 rows: the fused fp32 kernel; 48+: the dense GEMM (its own switch decides its dtype).
    w_q = random_blocks(96, 64, ops.GGML_Q4_1)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(4))
    fp32 = ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32, "fp32")
    assert torch.equal(ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32, "int8"), fp32)


# -- accuracy of the whole model --------------------------------------------------------------
# Bounds from measurements on the fixed inputs (docs/benchmarks.md, "int8 decode activations"),
# with a margin: 256 positions of docs/design.md, 16 a forward, gave max |logit diff| 3.8 and
# top-1 240/256; perplexity on 512 tokens 107.02 against fp32's 107.22; greedy 24 tokens,
# 6/8 outputs identical with SDPA as the prefill attention, 3/8 with the native prefill
# kernel (csrc/cpu/prefill_attention.cpp; top-1 then 244/256): the prompts' hidden states
# move by float rounding (<= 8e-5), and int8 decode's near-ties flip on that. Greedy
# identity over 24 tokens is a coarse signal for a path with ~5% top-1 disagreement; the
# logits and perplexity bounds are the accuracy checks.
TOKENS_PER_STEP = 16  # as 16 concurrent decode streams: the int8 kernel's target batch
MAX_LOGIT_DIFF = 6.0
MIN_TOP1 = 0.9
MIN_GREEDY_IDENTICAL = 2  # of 8
PPL_TOLERANCE = 1e-2  # |ppl_int8 / ppl_fp32 - 1|


@pytest.mark.slow
@needs_vnni
def test_int8_decode_logits_agree_with_fp32(monkeypatch):
    diff, top1 = decode_act_vs_fp32(monkeypatch, "int8", TOKENS_PER_STEP)
    assert 0 < diff < MAX_LOGIT_DIFF  # > 0: the int8 path really ran
    assert top1 >= MIN_TOP1


@pytest.mark.slow
@needs_vnni
def test_int8_decode_perplexity_within_one_percent(monkeypatch):
    monkeypatch.setenv(VAR, "int8")
    ppl = gguf_perplexities(TOKENS_PER_STEP)
    assert abs(ppl["gguf"] / ppl["fp32"] - 1) < PPL_TOLERANCE
    assert ppl["gguf"] != ppl["fp32"]  # the int8 path really ran


@pytest.mark.slow
@needs_vnni
def test_int8_decode_greedy_outputs(monkeypatch):
    # The prefill stays fp32 (exact) so the outputs differ by the decode steps alone; the
    # 8 prompts decode together: every decode step is an 8-row forward (the int8 kernel).
    monkeypatch.setenv("VLLM_CPU_GGUF_PREFILL_DTYPE", "fp32")
    same = greedy_same_as_fp32(monkeypatch, {VAR: "int8"})
    print(f"int8 decode: greedy outputs identical on {same}/{len(PROMPTS)} prompts")
    assert same >= MIN_GREEDY_IDENTICAL
