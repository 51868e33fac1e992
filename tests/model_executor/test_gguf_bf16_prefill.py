"""The gguf path's bf16 prefill: the VLLM_CPU_GGUF_PREFILL_DTYPE switch, which path a forward
takes, the bf16 GEMM against fp32 references with bf16 tolerances, and the whole model's
logits and perplexity against fp32 (slow).

bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 0.2%): a K-long dot product of bf16
inputs with fp32 accumulation is off by about sqrt(K) * 2^-9 of ``|x| . |w|`` at worst-case
alignment, typically far less; the tolerances below are 1% of that scale.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_quant_kernels import random_blocks
from tests.model_executor.test_gguf_quantization import (
    PROMPTS,
    gguf_perplexities,
    greedy_same_as_fp32,
    logits_agreement,
)
from vllm import _custom_ops as ops
from vllm import envs
from vllm.model_executor.layers.quantization import gguf

VAR = "VLLM_CPU_GGUF_PREFILL_DTYPE"


# -- the switch -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw,expected", [(None, "auto"), ("", "auto"), ("BF16", "bf16"), (" fp32 ", "fp32")]
)
def test_switch_parses(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, raw)
    assert envs.VLLM_CPU_GGUF_PREFILL_DTYPE == expected


@pytest.mark.parametrize("bad", ["fp16", "bfloat16x", "1"])
def test_bad_switch_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(VAR, bad)
    with pytest.raises(ValueError, match=VAR):
        _ = envs.VLLM_CPU_GGUF_PREFILL_DTYPE
    with pytest.raises(ValueError, match=VAR):
        gguf.prefill_dtype()


@pytest.mark.parametrize(
    "raw,hardware,expected",
    [
        ("auto", True, torch.bfloat16),
        ("auto", False, torch.float32),
        ("bf16", False, torch.bfloat16),  # forced: runs (slowly) even when emulated
        ("fp32", True, torch.float32),
    ],
)
def test_prefill_dtype_choice(monkeypatch, raw, hardware, expected):
    monkeypatch.setenv(VAR, raw)
    monkeypatch.setattr(gguf, "cpu_has_native_bf16", lambda: hardware)
    assert gguf.prefill_dtype() == expected


@pytest.mark.parametrize(
    "caps,expected",
    [
        ({"avx512_bf16": True, "amx_bf16": False, "avx512_f": True}, True),  # Zen 4
        ({"avx512_bf16": False, "amx_bf16": True}, True),  # Sapphire Rapids
        ({"avx512_bf16": False, "amx_bf16": False, "avx512_f": True}, False),  # Skylake-X
        ({"avx2": True}, False),
    ],
)
def test_native_bf16_detection_reads_the_cpuid_flags(monkeypatch, caps, expected):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    gguf.cpu_has_native_bf16.cache_clear()
    try:
        assert gguf.cpu_has_native_bf16() is expected
    finally:
        gguf.cpu_has_native_bf16.cache_clear()


# -- the GEMM ---------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", [ops.GGML_Q4_1, ops.GGML_Q8_0])
@pytest.mark.parametrize("rows,cols,tokens", [(96, 64, 48), (130, 576, 80)])
def test_bf16_linear_is_the_bf16_product_of_the_blocks(qtype, rows, cols, tokens):
    w_q = random_blocks(rows, cols, qtype, seed=rows)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(2))
    w = ops.ggml_dequantize_torch(w_q, qtype)
    got = ops.ggml_linear(x, w_q, qtype, 48, torch.bfloat16)
    assert got.dtype == torch.float32 and got.shape == (tokens, rows)
    # Exactly x and W rounded to bf16, multiplied in bf16 (the path really is bf16)...
    expected = torch.nn.functional.linear(x.bfloat16(), w.bfloat16()).float()
    assert torch.equal(got, expected)
    fp32 = torch.nn.functional.linear(x, w)
    assert not torch.equal(got, fp32)
    # ...and within bf16 rounding of the fp32 product.
    scale = torch.nn.functional.linear(x.abs(), w.abs()).max().item()
    err = (got - fp32).abs().max().item()
    assert err < 1e-2 * scale, (err, scale)


@pytest.mark.parametrize("tokens", [1, 5, 47])
def test_rows_below_the_threshold_stay_fp32(tokens):
    w_q = random_blocks(96, 64, ops.GGML_Q4_1)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3))
    fp32 = ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32)
    assert torch.equal(ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.bfloat16), fp32)


def test_fp32_prefill_is_bit_identical_to_the_reference():
    w_q = random_blocks(96, 64, ops.GGML_Q4_1)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    got = ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32)
    assert torch.equal(got, ops.ggml_linear_torch(x, w_q, ops.GGML_Q4_1))


def test_gguf_linear_passes_its_prefill_dtype():
    w_q = random_blocks(96, 64, ops.GGML_Q4_1)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(5))
    bf16 = gguf.GGUFLinear(w_q, ops.GGML_Q4_1, None, torch.bfloat16)
    fp32 = gguf.GGUFLinear(w_q, ops.GGML_Q4_1, None)
    assert torch.equal(bf16(x), ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.bfloat16))
    assert torch.equal(fp32(x), ops.ggml_linear_torch(x, w_q, ops.GGML_Q4_1))


def test_kept_bf16_between_gate_up_and_down_changes_no_number():
    # gate_up's bf16 product goes to silu_and_mul and down_proj without the fp32 round trip:
    # the same bits as converting it to fp32 and back (the MLP of a bf16 prefill).
    gate_up_q = random_blocks(2 * 96, 64, ops.GGML_Q4_1, seed=6)
    down_q = random_blocks(64, 96, ops.GGML_Q4_1, seed=7)
    x = torch.randn(60, 64, generator=torch.Generator().manual_seed(8))

    def mlp(keep: bool, tokens: int) -> torch.Tensor:
        gate_up = gguf.GGUFLinear(gate_up_q, ops.GGML_Q4_1, None, torch.bfloat16)
        down = gguf.GGUFLinear(down_q, ops.GGML_Q4_1, None, torch.bfloat16)
        if keep:
            assert gguf.keep_prefill_dtype_between(gate_up, down)
        return down(ops.silu_and_mul(gate_up(x[:tokens])))

    for tokens in (60, 5):  # a dense (prefill) forward, and block-kernel rows
        kept, plain = mlp(True, tokens), mlp(False, tokens)
        assert kept.dtype == plain.dtype == torch.float32
        assert torch.equal(kept, plain)
    fp32 = gguf.GGUFLinear(down_q, ops.GGML_Q4_1, None)
    assert not gguf.keep_prefill_dtype_between(fp32, fp32)  # only between bf16 GEMMs


# -- accuracy of the whole model --------------------------------------------------------------
# Bounds from measurements on the fixed inputs (docs/benchmarks.md, "bf16 prefill"), with a
# margin: the 8 prompts batched (115 positions) gave max |logit diff| 0.73 and top-1 114/115;
# greedy 24 tokens, 5/8 outputs identical (the others diverge at tokens 5, 21, 21). With
# the native prefill attention's bf16 products as well: 0.58, 114/115 and 6/8.
MAX_LOGIT_DIFF = 1.5
MIN_TOP1 = 0.97  # at most 3 of the 115 positions
MIN_GREEDY_IDENTICAL = 4  # of 8
PPL_TOLERANCE = 1e-2  # |ppl_bf16 / ppl_fp32 - 1|


@torch.inference_mode()
def _batched_logits(runner, seqs: list[list[int]]) -> torch.Tensor:
    """Logits at every position of ``seqs`` prefilled together in one forward (as the
    engine batches prompts: the forward has sum(len) rows, so the prefill path)."""
    layout, first = [], 1
    for ids in seqs:
        n_blocks = -(-len(ids) // 16)
        layout.append((0, len(ids), list(range(first, first + n_blocks))))
        first += n_blocks
    meta = runner.attn_backend.build_metadata(layout)
    ids = torch.tensor([t for s in seqs for t in s])
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    return runner.model.compute_logits(runner.model(ids, positions, meta, runner.kv_caches))


@pytest.mark.slow
def test_bf16_prefill_logits_agree_with_fp32(tokenizer, monkeypatch):
    from vllm.benchmarks.model_runner import load_runner, quantize

    monkeypatch.setenv(VAR, "bf16")
    seqs = [tokenizer(p).input_ids for p in PROMPTS]
    runner = load_runner(sum(len(s) + 16 for s in seqs))
    assert not runner.attn_backend.prefill_bf16  # fp32 attention
    fp32 = _batched_logits(runner, seqs)
    quantize(runner)
    # The prefill's attention products follow its GEMMs into bf16 (the native kernel).
    assert runner.attn_backend.prefill_bf16
    assert runner.model.layers[0].attn_forward == runner.attn_backend.forward
    linears = [m for m in runner.model.modules() if isinstance(m, gguf.GGUFLinear)]
    assert {m.prefill_dtype for m in linears} == {torch.bfloat16}
    assert all(layer.gate_up_proj.keep_prefill_dtype for layer in runner.model.layers)
    bf16 = _batched_logits(runner, seqs)
    diff, top1 = logits_agreement(bf16, fp32)
    print(f"bf16 prefill: max |logit diff| {diff:.3f}, top-1 agreement {top1:.4f}")
    assert 0 < diff < MAX_LOGIT_DIFF  # > 0: the bf16 path really ran
    assert top1 >= MIN_TOP1


@pytest.mark.slow
def test_bf16_prefill_perplexity_within_one_percent(monkeypatch):
    monkeypatch.setenv(VAR, "bf16")
    ppl = gguf_perplexities(128)  # 128 rows a forward: bf16 GEMMs
    assert abs(ppl["gguf"] / ppl["fp32"] - 1) < PPL_TOLERANCE
    assert ppl["gguf"] != ppl["fp32"]  # the bf16 path really ran


@pytest.mark.slow
def test_bf16_prefill_greedy_outputs(monkeypatch):
    # One step prefills all 8 prompts together (115 rows): the bf16 GEMMs.
    same = greedy_same_as_fp32(monkeypatch, {VAR: "bf16"})
    print(f"bf16 prefill: greedy outputs identical on {same}/{len(PROMPTS)} prompts")
    assert same >= MIN_GREEDY_IDENTICAL


@pytest.mark.parametrize(
    "capability,dtype,expected",
    [
        ("AVX2", torch.float32, gguf.NEVER_DENSE),  # the AVX2 panels beat dequantize + GEMM
        ("AVX512", torch.float32, gguf.DENSE_MIN_TOKENS),
        ("AVX2", torch.bfloat16, gguf.DENSE_MIN_TOKENS),
        ("AVX512", torch.bfloat16, gguf.DENSE_MIN_TOKENS),
    ],
)
def test_dense_threshold_follows_the_cpu(monkeypatch, capability, dtype, expected):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert gguf.dense_min_tokens(dtype) == expected
    layer = gguf.GGUFLinear(
        random_blocks(96, 64, ops.GGML_Q4_1),
        ops.GGML_Q4_1,
        None,
        dtype,
        dense_min_tokens=gguf.dense_min_tokens(dtype),
    )
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(9))
    dense = ops.ggml_linear(x, layer.qweight, ops.GGML_Q4_1, 48, dtype)
    blocks = ops.ggml_linear(x, layer.qweight, ops.GGML_Q4_1, gguf.NEVER_DENSE, dtype)
    assert not torch.equal(dense, blocks)  # so the next line tells which path ran
    assert torch.equal(layer(x), dense if expected == gguf.DENSE_MIN_TOKENS else blocks)
