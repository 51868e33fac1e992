"""The gguf path's int8 decode activations: the VLLM_CPU_GGUF_DECODE_ACT switch and which
forwards take it (the whole model's accuracy: test_gguf_decode_accuracy.py).

int8 rounds each 32-value block of a row to 255 levels (dx = amax / 127): each input is off by
at most dx / 2, so a dot product by at most sum(|w| * dx / 2); the kernel tests hold it to that
bound (tests/kernels/test_quant_kernels.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_quant_kernels import cpu_has_avx512_vnni, random_blocks
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
