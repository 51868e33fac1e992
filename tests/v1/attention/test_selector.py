"""The backend selector's decisions, without a GPU (CUDA and the package are faked), and
the backend registry it iterates: a backend registered here is selected like the built-in
ones."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.attention import selector
from vllm.v1.attention.backends import flash_attn, registry, torch_flash
from vllm.v1.attention.backends.abstract import AttentionBackend
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend
from vllm.v1.attention.backends.triton_mla import TritonMLABackend

CUDA = torch.device("cuda")  # a device object only: nothing is allocated on it
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_forced_backend(monkeypatch):
    monkeypatch.delenv(selector.ENV_VAR, raising=False)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA present with torch's FlashAttention usable (an Ampere+ GPU), and the flash-attn
    package importable too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch_flash, "flash_unavailable_reason", lambda device: None)
    monkeypatch.setattr(flash_attn, "flash_attn_importable", lambda: True)


@pytest.fixture
def no_torch_flash(monkeypatch):
    """torch's FlashAttention cannot run (an older torch, say): the package is next."""
    monkeypatch.setattr(
        torch_flash, "flash_unavailable_reason", lambda device: "no varlen_attn (test)"
    )


BUILT_IN = "TORCH_FLASH_ATTN, FLASH_ATTN, TRITON_MLA, TORCH_SDPA"


def test_registry_names_the_built_in_backends():
    assert registry.backend_names() == tuple(BUILT_IN.split(", "))
    assert registry.get_backend_class("TORCH_FLASH_ATTN") is TorchFlashAttentionBackend
    assert registry.get_backend_class("TORCH_SDPA") is TorchSDPABackend
    assert registry.get_backend_class("FLASH_ATTN") is FlashAttentionBackend
    assert registry.get_backend_class("TRITON_MLA") is TritonMLABackend
    with pytest.raises(ValueError, match=f"XFORMERS.*{BUILT_IN}"):
        registry.get_backend_class("XFORMERS")


def test_cuda_prefers_torch_flash_attn_in_half_precision(fake_cuda, caplog):
    # Ahead of the flash-attn package even where that is installed; silently.
    for dtype in (torch.bfloat16, torch.float16):
        cls = selector.select_attention_backend(CUDA, dtype, 16, 128)
        assert cls is TorchFlashAttentionBackend and not cls.decodes_first
    assert "Not using" not in caplog.text


def test_cuda_fp32_keeps_the_torch_backend(fake_cuda, caplog):
    # fp32 is the exactness reference: neither FlashAttention runs it.
    assert selector.select_attention_backend(CUDA, torch.float32, 16, 128) is TorchSDPABackend
    assert "Not using TORCH_FLASH_ATTN: dtype torch.float32" in caplog.text


def test_mla_models_on_cuda_take_triton_mla_and_no_other_model_does(fake_cuda, caplog):
    # The latent cache (MLA: 576-wide keys, values their first 512 dims) goes to TRITON_MLA
    # ahead of everything, silently; a model without it never hears of TRITON_MLA.
    latent = frozenset({"latent_kv"})
    for dtype in (torch.bfloat16, torch.float32):
        cls = selector.select_attention_backend(CUDA, dtype, 16, 576, features=latent)
        assert cls is TritonMLABackend and cls.decodes_first
    fp8 = latent | {"fp8_kv_cache"}
    assert selector.select_attention_backend(CUDA, torch.bfloat16, 16, 576, features=fp8) is (
        TritonMLABackend
    )
    assert "Not using" not in caplog.text
    for dtype in (torch.bfloat16, torch.float32):
        selector.select_attention_backend(CUDA, dtype, 16, 128)
    assert "TRITON_MLA" not in caplog.text


def test_torch_flash_attn_reasons(fake_cuda):
    validate = TorchFlashAttentionBackend.validate_configuration
    assert validate(CUDA, torch.bfloat16, 16, 128) == []
    assert validate(CUDA, torch.bfloat16, 16, 60) == [
        "head size 60 is not supported by TORCH_FLASH_ATTN"
    ]
    assert validate(CUDA, torch.bfloat16, 16, 512) != []
    assert "needs CUDA" in validate(CPU, torch.bfloat16, 16, 128)[0]


def test_unavailable_torch_flash_attn_is_a_warning_on_cuda(fake_cuda, no_torch_flash, caplog):
    assert selector.select_attention_backend(CUDA, torch.bfloat16, 16, 64) is FlashAttentionBackend
    assert "Not using TORCH_FLASH_ATTN: no varlen_attn (test); using FLASH_ATTN" in caplog.text


def test_cpu_uses_torch(monkeypatch):
    # Even with the package importable, CPU tensors cannot go to a CUDA kernel.
    monkeypatch.setattr(flash_attn, "flash_attn_importable", lambda: True)
    cls = selector.select_attention_backend(CPU, torch.float32, 16, 64)
    assert cls is TorchSDPABackend and cls.decodes_first
    backend = cls(9, 3, 64, torch.float32, CPU, 16)
    assert backend.detail == ""
    backend.use_prefill_dtype(torch.bfloat16)  # the gguf path's bf16 prefill GEMMs
    assert backend.prefill_bf16 and backend.detail == "bf16 prefill products"
    backend.use_prefill_dtype(None)
    assert not backend.prefill_bf16


def test_cuda_picks_flash_attn_and_mode_follows_block_size(fake_cuda, no_torch_flash):
    cls = selector.select_attention_backend(CUDA, torch.bfloat16, 16, 64)
    assert cls is FlashAttentionBackend and not cls.decodes_first
    gathered = cls(8, 8, 64, torch.bfloat16, CUDA, 16)
    assert "gathered" in gathered.detail
    assert selector.select_attention_backend(CUDA, torch.float16, 256, 64) is cls
    paged = cls(8, 8, 64, torch.float16, CUDA, 256)
    assert "block_table" in paged.detail


@pytest.mark.parametrize(
    ("dtype", "head_dim", "importable"),
    [
        (torch.float32, 64, True),
        (torch.bfloat16, 60, True),
        (torch.bfloat16, 512, True),
        (torch.bfloat16, 64, False),
    ],
)
def test_cuda_falls_back_to_torch(
    fake_cuda, no_torch_flash, monkeypatch, caplog, dtype, head_dim, importable
):
    monkeypatch.setattr(flash_attn, "flash_attn_importable", lambda: importable)
    assert selector.select_attention_backend(CUDA, dtype, 16, head_dim) is TorchSDPABackend
    # On CUDA, not getting flash-attn is worth a warning (on CPU it is expected).
    assert "Not using FLASH_ATTN" in caplog.text


def test_env_forces_torch(fake_cuda, monkeypatch):
    monkeypatch.setenv(selector.ENV_VAR, "torch_sdpa")
    assert selector.select_attention_backend(CUDA, torch.bfloat16, 16, 64) is TorchSDPABackend


def test_env_forcing_flash_attn_fails_loudly_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv(selector.ENV_VAR, "FLASH_ATTN")
    with pytest.raises(ValueError, match="needs CUDA"):
        selector.select_attention_backend(CPU, torch.float32, 16, 64)
    monkeypatch.setenv(selector.ENV_VAR, "XFORMERS")
    with pytest.raises(ValueError, match=f"XFORMERS.*{BUILT_IN}"):
        selector.select_attention_backend(CPU, torch.float32, 16, 64)


class ToyBackend(AttentionBackend):
    """A registered backend that prefers itself on CPU for block size 8 and head size 4."""

    name = "TOY"
    priority = 100
    device_types = ("cpu",)

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        return block_size == 8

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size == 4

    def build_metadata(self, seqs):
        return seqs

    def forward(self, q, k, v, kv_cache, meta, scale):
        return q


@pytest.fixture
def toy_registered(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    registry.register_backend("TOY", ToyBackend)


def test_a_registered_backend_is_selected_where_it_supports_the_settings(toy_registered):
    assert "TOY" in registry.backend_names()
    assert selector.select_attention_backend(CPU, torch.float32, 8, 4) is ToyBackend
    # Where it cannot run, the selector goes on down the priorities, silently on CPU.
    assert selector.select_attention_backend(CPU, torch.float32, 16, 4) is TorchSDPABackend
    assert selector.select_attention_backend(CPU, torch.float32, 8, 64) is TorchSDPABackend


def test_forcing_a_registered_backend_names_why_it_cannot_run(toy_registered, monkeypatch):
    monkeypatch.setenv(selector.ENV_VAR, "toy")
    assert selector.select_attention_backend(CPU, torch.float32, 8, 4) is ToyBackend
    with pytest.raises(ValueError, match="TOY but block size 16"):
        selector.select_attention_backend(CPU, torch.float32, 16, 4)
    with pytest.raises(ValueError, match="device is cuda, TOY needs CPU"):
        selector.select_attention_backend(CUDA, torch.float32, 8, 4)


def test_register_backend_checks_the_name():
    with pytest.raises(ValueError, match="upper case"):
        registry.register_backend("toy", ToyBackend)


def test_the_flag_forces_a_backend_over_the_variable(fake_cuda, monkeypatch):
    monkeypatch.setenv(selector.ENV_VAR, "FLASH_ATTN")
    pick = selector.select_attention_backend
    assert pick(CUDA, torch.bfloat16, 16, 128) is FlashAttentionBackend  # the variable
    assert pick(CUDA, torch.bfloat16, 16, 128, "TORCH_SDPA") is TorchSDPABackend  # the flag
    with pytest.raises(ValueError, match="--attention-backend=TORCH_FLASH_ATTN but"):
        pick(CPU, torch.float32, 16, 64, "TORCH_FLASH_ATTN")  # cannot run: no fallback


@pytest.mark.slow
def test_an_engine_runs_the_backend_its_flag_names(tmp_path):
    from tests.entrypoints.test_generation_config import tiny_model
    from vllm import LLM

    model = tiny_model(tmp_path / "tiny")
    llm = LLM(model=model, kv_cache_memory="16MiB", attention_backend="TORCH_SDPA")
    try:
        assert llm.engine_core.model_runner.attn_backend.name == "TORCH_SDPA"
    finally:
        llm.shutdown()
    with pytest.raises(Exception, match="--attention-backend=TORCH_FLASH_ATTN but"):
        LLM(model=model, kv_cache_memory="16MiB", attention_backend="TORCH_FLASH_ATTN")
