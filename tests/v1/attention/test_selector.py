"""The backend selector's decisions, without a GPU (CUDA and the package are faked)."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention import selector
from vllm.v1.attention.backends import flash_attn, torch_sdpa

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA present and flash-attn importable, as on a GPU box with the `cuda` extra."""
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(selector, "_flash_attn_importable", lambda: True)


def test_cpu_uses_torch(monkeypatch):
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    # Even with the package importable, CPU tensors cannot go to a CUDA kernel.
    monkeypatch.setattr(selector, "_flash_attn_importable", lambda: True)
    backend = selector.select_attention_backend(torch.device("cpu"), torch.float32, 16, 64)
    assert backend.name == selector.TORCH_SDPA
    assert backend.forward is torch_sdpa.paged_attention
    assert backend.decodes_first


def test_cuda_picks_flash_attn_and_mode_follows_block_size(fake_cuda):
    gathered = selector.select_attention_backend(CUDA, torch.bfloat16, 16, 64)
    assert gathered.name == selector.FLASH_ATTN
    assert gathered.forward is flash_attn.flash_paged_attention
    assert not gathered.decodes_first
    assert "gathered" in gathered.detail
    paged = selector.select_attention_backend(CUDA, torch.float16, 256, 64)
    assert paged.name == selector.FLASH_ATTN and "block_table" in paged.detail


@pytest.mark.parametrize(
    ("dtype", "head_dim", "importable"),
    [
        (torch.float32, 64, True),
        (torch.bfloat16, 60, True),
        (torch.bfloat16, 512, True),
        (torch.bfloat16, 64, False),
    ],
)
def test_cuda_falls_back_to_torch(fake_cuda, monkeypatch, dtype, head_dim, importable):
    monkeypatch.setattr(selector, "_flash_attn_importable", lambda: importable)
    backend = selector.select_attention_backend(CUDA, dtype, 16, head_dim)
    assert backend.name == selector.TORCH_SDPA


def test_env_forces_torch(fake_cuda, monkeypatch):
    monkeypatch.setenv(selector.ENV_VAR, "torch_sdpa")
    assert selector.select_attention_backend(CUDA, torch.bfloat16, 16, 64).name == "TORCH_SDPA"


def test_env_forcing_flash_attn_fails_loudly_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv(selector.ENV_VAR, "FLASH_ATTN")
    with pytest.raises(ValueError, match="needs CUDA"):
        selector.select_attention_backend(torch.device("cpu"), torch.float32, 16, 64)
    monkeypatch.setenv(selector.ENV_VAR, "XFORMERS")
    with pytest.raises(ValueError, match="XFORMERS"):
        selector.select_attention_backend(torch.device("cpu"), torch.float32, 16, 64)
