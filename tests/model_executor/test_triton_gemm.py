"""The checks and output every weight-format GEMM wrapper starts from (``start_gemm``)."""

import pytest
import torch

from vllm.model_executor.layers.triton_gemm import TILE_SIZES, default_block_m, start_gemm


def test_bad_tiles_name_the_wrapper_and_the_tiles():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"my_gemm: tiles block_m=8, block_n=16"):
        start_gemm("my_gemm", "test kernel", x, 32, (8, 16, 16), (16, 32))
    with pytest.raises(ValueError, match=r"block_k=64 in \(16, 32\)"):
        start_gemm("my_gemm", "test kernel", x, 32, (16, 16, 64), (16, 32))
    with pytest.raises(ValueError, match="dividing the blocks' 48 columns"):
        start_gemm("my_gemm", "test kernel", x, 32, (16, 16, 32), (16, 32), k_divides=48)


def test_a_device_the_kernel_cannot_run_on_is_a_runtime_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="my_gemm: .*test kernel runs on CUDA, not cpu"):
        start_gemm("my_gemm", "test kernel", x, 32, (16, 16, 16), (16,))


def test_output_and_grid(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.zeros(40, 8, dtype=torch.bfloat16)
    out, grid = start_gemm("my_gemm", "test kernel", x, 100, (16, 32, 16), (16,))
    assert out.shape == (40, 100) and out.dtype == torch.bfloat16
    assert grid == (3, 4)  # ceil(40 / 16), ceil(100 / 32)
    out, grid = start_gemm("my_gemm", "test kernel", x[:0], 100, (16, 32, 16), (16,))
    assert out.shape == (0, 100) and grid is None  # nothing to launch
    assert start_gemm("g", "k", x, 0, (16, 16, 16), (16,))[1] is None


def test_default_block_m_is_a_tile_size():
    assert default_block_m(1) == 16 and default_block_m(257) == 64
    assert default_block_m(100, decode_rows=64) == 64
    assert {default_block_m(n) for n in (1, 256, 257, 4096)} <= set(TILE_SIZES)
