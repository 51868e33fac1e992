"""GGUF block kernels: the pure-torch reference equals gguf-py's dequantization bit for bit,
and the native kernels equal the reference (dequantize: bit for bit; linear: up to float
rounding) on random blocks of odd shapes. The native build is slow: those tests are marked."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from vllm import _custom_ops as ops

QTYPES = [ops.GGML_Q4_1, ops.GGML_Q8_0]
# (out rows, in features, tokens): odd row counts (a lone last row), one-block rows, token
# counts around the 4-token tile, and a batch past the dense-GEMM threshold.
SHAPES = [(1, 32, 1), (7, 64, 5), (33, 96, 3), (960, 576, 1), (576, 1536, 16), (130, 576, 50)]


def random_blocks(rows: int, cols: int, qtype: int, seed: int = 0) -> torch.Tensor:
    """Random GGUF blocks with realistic fp16 scales (random bytes would give inf/nan)."""
    g = torch.Generator().manual_seed(seed)
    nb, bb = cols // ops.GGML_BLOCK_WEIGHTS, ops.GGML_BLOCK_BYTES[qtype]
    blocks = torch.randint(0, 256, (rows, nb, bb), dtype=torch.uint8, generator=g)
    d = (torch.rand(rows, nb, 1, generator=g) * 0.02 + 1e-3).half()
    blocks[..., 0:2] = d.view(torch.uint8)
    if qtype == ops.GGML_Q4_1:
        m = -torch.rand(rows, nb, 1, generator=g) * 0.1
        blocks[..., 2:4] = m.half().view(torch.uint8)
    return blocks.reshape(rows, nb * bb).contiguous()


@pytest.mark.parametrize("qtype", QTYPES)
def test_torch_dequantize_equals_gguf_py(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    blocks = random_blocks(9, 96, qtype)
    expected = dequantize(blocks.numpy(), GGMLQuantizationType(qtype))
    got = ops.ggml_dequantize_torch(blocks, qtype)
    assert got.shape == (9, 96)
    assert np.array_equal(got.numpy(), expected)


def test_q4_1_nibble_layout():
    # Byte j holds weight j (low nibble) and weight j + 16 (high nibble); w = q * d + m.
    block = torch.zeros(1, 20, dtype=torch.uint8)
    block[0, 0:2] = torch.tensor([2.0]).half().view(torch.uint8)
    block[0, 2:4] = torch.tensor([-1.0]).half().view(torch.uint8)
    block[0, 4] = 0x53  # weight 0: q=3, weight 16: q=5
    w = ops.ggml_dequantize_torch(block, ops.GGML_Q4_1)[0]
    assert w[0] == 5.0 and w[16] == 9.0 and w[1] == -1.0


def test_unsupported_type_is_refused():
    with pytest.raises(ValueError, match="unsupported GGML type"):
        ops.ggml_dequantize_torch(torch.zeros(1, 18, dtype=torch.uint8), 2)


@pytest.fixture(scope="module")
def native():
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not ops.has_quant_kernels():
        ops.build()
    assert ops.has_quant_kernels()
    return ops._quant_ops()


@pytest.mark.slow
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,cols,tokens", SHAPES)
def test_native_linear_matches_reference(native, qtype, rows, cols, tokens):
    w = random_blocks(rows, cols, qtype, seed=rows + tokens)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(1))
    expected = ops.ggml_linear_torch(x, w, qtype)
    got = native.ggml_linear(x, w, qtype)
    # Only the summation order differs: the error is a few ulps of the row's |w| . |x|.
    scale = ops.ggml_linear_torch(x.abs(), w, qtype).abs().max().item() + 1.0
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5 * scale
    # The public entry point (block kernel or dense GEMM by batch size) agrees too.
    assert torch.allclose(ops.ggml_linear(x, w, qtype, 16), expected, atol=1e-5 * scale)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", QTYPES)
def test_native_dequantize_is_bit_identical(native, qtype):
    w = random_blocks(37, 160, qtype)
    assert torch.equal(native.ggml_dequantize(w, qtype), ops.ggml_dequantize_torch(w, qtype))


@pytest.mark.slow
def test_native_linear_rejects_bad_shapes(native):
    w = random_blocks(4, 64, ops.GGML_Q4_1)
    with pytest.raises(RuntimeError, match="features"):
        native.ggml_linear(torch.randn(2, 32), w, ops.GGML_Q4_1)
    with pytest.raises(RuntimeError, match="whole blocks"):
        native.ggml_linear(torch.randn(2, 64), w[:, :30].contiguous(), ops.GGML_Q4_1)
