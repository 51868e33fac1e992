"""GGUF block kernels: the pure-torch reference equals gguf-py's dequantization bit for bit,
and the native kernels equal the reference (dequantize: bit for bit; linear: up to float
rounding) on random blocks of odd shapes. The native build is slow: those tests are marked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.conftest import require_native
from vllm import _custom_ops as ops

QTYPES = [ops.GGML_Q4_1, ops.GGML_Q8_0]
# (out rows, in features, tokens): odd row counts (a lone last row), one-block rows, token
# counts around the 4-token tile, and a batch past the dense-GEMM threshold. From 5 tokens on:
# the AVX-512 tiles (4 rows; up to 6 tokens in fp32, split evenly: 7 tokens 4 + 3, 13 tokens
# 5 + 4 + 4; 16 in int8) with partial last tiles, and K not a multiple of 512.
SHAPES = [(1, 32, 1), (7, 64, 5), (33, 96, 3), (960, 576, 1), (576, 1536, 16), (130, 576, 50)]
SHAPES += [(131, 544, 8), (577, 608, 17), (35, 96, 47), (33, 1056, 16), (9, 64, 5), (3, 32, 32)]
SHAPES += [(70, 96, 7), (5, 160, 13)]
# The AVX2 panels (48 rows expanded at once, tiles of 3 rows x 4 tokens): a panel and a part,
# row and token remainders, and a prefill-sized batch.
SHAPES += [(97, 64, 9), (50, 96, 12), (98, 64, 259)]
# The AVX-512 fused kernel (1-4 tokens, groups of 4 rows with prefetches ahead): partial
# last groups of 2 and 3 rows, and Q8_0 rows long enough that a group is prefetched whole.
SHAPES += [(6, 64, 2), (7, 96, 4), (131, 1536, 4), (2050, 576, 2)]
DECODE_SHAPES = [s for s in SHAPES if 5 <= s[2] < 48]
VARIANT_FP32, VARIANT_INT8, VARIANT_AVX2 = 0, 1, 2  # ggml_linear's ``variant`` argument


def cpu_has_avx512_vnni() -> bool:
    """The int8 kernel's instructions (else variant 1 runs the fp32 kernel)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(flag in flags for flag in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))


def ggml_linear_int8_torch(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The int8 kernel's arithmetic in torch (float64 sums): each 32-value block of x rounded to
    q = round(x * (1 / dx)), dx = amax / 127; y = sum over blocks of dw * dx * sum(qw * q)
    + m * dx * sum(q) (Q8_0: no m term)."""
    m_rows, k = x.shape
    n = qweight.shape[0]
    xb = x.view(m_rows, k // 32, 32)
    dx = xb.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(dx > 0, 1.0 / dx, torch.zeros_like(dx))
    q = torch.round(xb * inv).double()  # (M, nb, 32)
    dx = dx.double().squeeze(-1)  # (M, nb)
    blocks = qweight.view(n, -1, ops.GGML_BLOCK_BYTES[qtype])
    dw = blocks[..., 0:2].contiguous().view(torch.float16).double().squeeze(-1)  # (N, nb)
    if qtype == ops.GGML_Q8_0:
        qw = blocks[..., 2:].contiguous().view(torch.int8).double()
        mw = torch.zeros_like(dw)
    else:
        mw = blocks[..., 2:4].contiguous().view(torch.float16).double().squeeze(-1)
        qw = torch.cat([blocks[..., 4:] & 0x0F, blocks[..., 4:] >> 4], dim=-1).double()
    dots = torch.einsum("mbk,nbk->mnb", q, qw)  # (M, N, nb)
    y = dots * dx[:, None, :] * dw[None] + mw[None] * (dx * q.sum(-1))[:, None, :]
    return y.sum(-1).float()


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
    require_native(ops.has_quant_kernels)
    return ops._quant_ops()


@pytest.mark.slow
@pytest.mark.parametrize("variant", [VARIANT_FP32, VARIANT_AVX2])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,cols,tokens", SHAPES)
def test_native_linear_matches_reference(native, qtype, rows, cols, tokens, variant):
    w = random_blocks(rows, cols, qtype, seed=rows + tokens)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(1))
    expected = ops.ggml_linear_torch(x, w, qtype)
    got = native.ggml_linear(x, w, qtype, variant)
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


@pytest.mark.parametrize("qtype", QTYPES)
def test_bf16_dequantize_is_the_rounded_fp32_matrix(native, qtype):
    # One pass to bf16 natively: the same bits as rounding the fp32 matrix (nearest even).
    w = random_blocks(37, 1536, qtype, seed=2)
    expected = ops.ggml_dequantize_torch(w, qtype).to(torch.bfloat16)
    got = ops.ggml_dequantize(w, qtype, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    native_bits = native.ggml_dequantize_bf16(w, qtype).view(torch.int16)
    assert torch.equal(native_bits, got.view(torch.int16))


def test_dequantize_refuses_other_dtypes():
    with pytest.raises(ValueError, match="dtype"):
        ops.ggml_dequantize(random_blocks(2, 32, ops.GGML_Q4_1), ops.GGML_Q4_1, torch.float16)


@pytest.mark.slow
def test_native_linear_rejects_bad_shapes(native):
    w = random_blocks(4, 64, ops.GGML_Q4_1)
    with pytest.raises(RuntimeError, match="features"):
        native.ggml_linear(torch.randn(2, 32), w, ops.GGML_Q4_1)
    with pytest.raises(RuntimeError, match="whole blocks"):
        native.ggml_linear(torch.randn(2, 64), w[:, :30].contiguous(), ops.GGML_Q4_1)


@pytest.mark.slow
@pytest.mark.skipif(not cpu_has_avx512_vnni(), reason="no AVX512-VNNI: variant 1 runs fp32")
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,cols,tokens", DECODE_SHAPES)
def test_native_int8_linear(native, qtype, rows, cols, tokens):
    w = random_blocks(rows, cols, qtype, seed=rows + tokens)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0.0  # an all-zero block: dx = 0, no division by zero
    got = native.ggml_linear(x, w, qtype, VARIANT_INT8)
    scale = ops.ggml_linear_torch(x.abs(), w, qtype).abs().max().item() + 1.0
    # The same quantized x and integer sums as the torch reference: float rounding apart.
    assert (got - ggml_linear_int8_torch(x, w, qtype)).abs().max().item() <= 1e-5 * scale
    # Against fp32 x: each input is off by at most dx / 2, so each output by at most
    # sum(|w| * dx / 2) over its row.
    dx = x.view(tokens, -1, 32).abs().amax(-1) / 127.0  # (M, nb)
    w_abs = ops.ggml_dequantize_torch(w, qtype).abs()
    bound = torch.nn.functional.linear(dx.repeat_interleave(32, dim=1) / 2, w_abs)
    err = (got - ops.ggml_linear_torch(x, w, qtype)).abs()
    assert bool((err <= bound * 1.001 + 1e-5 * scale).all())
    assert err.max().item() > 0  # the int8 path really ran


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 4])
def test_native_int8_leaves_small_batches_fp32(native, tokens):
    w = random_blocks(33, 96, ops.GGML_Q4_1)
    x = torch.randn(tokens, 96, generator=torch.Generator().manual_seed(2))
    fp32 = native.ggml_linear(x, w, ops.GGML_Q4_1, VARIANT_FP32)
    assert torch.equal(native.ggml_linear(x, w, ops.GGML_Q4_1, VARIANT_INT8), fp32)


@pytest.mark.slow
def test_native_linear_rejects_unknown_variant(native):
    w = random_blocks(4, 64, ops.GGML_Q4_1)
    for variant in (-1, 4):
        with pytest.raises(RuntimeError, match="variant"):
            native.ggml_linear(torch.randn(8, 64), w, ops.GGML_Q4_1, variant)
