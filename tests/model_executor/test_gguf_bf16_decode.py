"""The gguf path's bf16 decode on AMX tiles (5-47 rows): the kernel against a bf16-rounded
reference, which forwards take it, and the auto choice (the whole model's accuracy:
test_gguf_decode_accuracy.py).

bf16 keeps 8 bits of mantissa: each weight (q * d + m) and each input is off by at most
2^-9 of itself, the products are exact in fp32 and summed in fp32, so the kernel matches a
reference that rounds x and W to bf16 first and multiplies in fp32, to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_quant_kernels import random_blocks
from vllm import _custom_ops as ops
from vllm.model_executor.layers.quantization import gguf

VAR = "VLLM_CPU_GGUF_DECODE_ACT"
needs_amx = pytest.mark.skipif(not gguf.cpu_has_amx_bf16(), reason="bf16 decode needs AMX-BF16")
# Tokens: one, two and three 16-token tiles, partial tiles; rows: 16-row groups, partial ones.
CASES = [(96, 64, 5), (33, 96, 16), (577, 1536, 17), (20, 64, 32), (130, 576, 47), (16, 32, 8)]


def bf16_reference(x: torch.Tensor, w_q: torch.Tensor, qtype: int) -> torch.Tensor:
    w = ops.ggml_dequantize_torch(w_q, qtype)
    return torch.nn.functional.linear(x.bfloat16().float(), w.bfloat16().float())


@pytest.fixture(scope="module")
def native():
    if not ops.ensure_quant_kernels():
        pytest.skip("native quantized kernels are not built")


@needs_amx
@pytest.mark.parametrize("qtype", [ops.GGML_Q4_1, ops.GGML_Q8_0])
@pytest.mark.parametrize("rows,cols,tokens", CASES)
def test_bf16_kernel_matches_bf16_reference(native, qtype, rows, cols, tokens):
    w_q = random_blocks(rows, cols, qtype, seed=rows + tokens)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(5))
    got = ops.ggml_linear(x, w_q, qtype, 48, torch.float32, "bf16")
    scale = ops.ggml_linear_torch(x.abs(), w_q, qtype).abs().max().item() + 1.0
    # Against the bf16-rounded operands: fp32 summation order only.
    assert (got - bf16_reference(x, w_q, qtype)).abs().max().item() <= 1e-5 * scale
    # Against fp32: bf16's rounding, and visibly so (the bf16 path really ran).
    off = (got - ops.ggml_linear_torch(x, w_q, qtype)).abs().max().item()
    assert 0 < off <= 2**-7 * scale


@needs_amx
def test_decode_layer_takes_bf16(native):
    w_q = random_blocks(96, 64, ops.GGML_Q4_1)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(6))
    layer = gguf.GGUFLinear(w_q, ops.GGML_Q4_1, None, decode_act="bf16")
    assert torch.equal(layer(x), ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32, "bf16"))
    assert not torch.equal(layer(x), ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48))


@pytest.mark.parametrize("tokens", [1, 4, 48, 64])
def test_small_and_prefill_batches_ignore_bf16_decode(native, tokens):
    # 1-4 rows: the fused fp32 kernel; 48+: the dense GEMM (its own switch decides its dtype).
    w_q = random_blocks(96, 64, ops.GGML_Q4_1)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(7))
    fp32 = ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32, "fp32")
    assert torch.equal(ops.ggml_linear(x, w_q, ops.GGML_Q4_1, 48, torch.float32, "bf16"), fp32)


@pytest.mark.parametrize("prefill", ["fp32", "bf16"])
def test_auto_follows_the_prefill_and_the_cpu(monkeypatch, prefill):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("VLLM_CPU_GGUF_PREFILL_DTYPE", prefill)
    expected = "bf16" if prefill == "bf16" and gguf.cpu_has_amx_bf16() else "fp32"
    assert gguf.decode_act() == expected
    monkeypatch.setenv(VAR, "fp32")  # an explicit choice wins
    assert gguf.decode_act() == "fp32"
