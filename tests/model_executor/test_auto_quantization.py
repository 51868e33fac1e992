"""``--quantization`` left unset (None) chooses at load: gguf for a GGUF model on CPU in
float32 when the native quantized kernels are built, fp32 (dense) for anything else;
``fp32`` and ``gguf`` force their format."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.tiny_models import load_cpu_runner
from vllm import _custom_ops as ops
from vllm.config import ModelConfig
from vllm.model_executor.model_loader import apply_quantization, resolve_quantization

CPU = torch.device("cpu")


@pytest.fixture
def kernels(monkeypatch):
    """The native quantized kernels: built (True) or not, whatever this machine has."""

    def set_built(built: bool) -> None:
        monkeypatch.setattr(ops, "has_quant_kernels", lambda: built)

    set_built(True)
    return set_built


@pytest.fixture
def gguf_path(tmp_path):
    path = tmp_path / "model.gguf"  # only its name and existence are looked at
    path.write_bytes(b"GGUF")
    return str(path)


def choice(model: str, quantization=None, device=CPU, dtype=torch.float32) -> str:
    config = ModelConfig(model=model, quantization=quantization)
    return resolve_quantization(config, device, dtype)[0]


def test_gguf_models_on_cpu_in_fp32_default_to_gguf(kernels, gguf_path):
    assert choice("SmolLM2-135M-Instruct") == "gguf"  # the embedded model is a GGUF
    assert choice(gguf_path) == "gguf"


def test_everything_else_defaults_to_dense(kernels, gguf_path, tmp_path):
    assert resolve_quantization(ModelConfig(model=str(tmp_path)), CPU, torch.float32) == (
        "fp32",
        "auto: not a .gguf model",
    )
    assert choice(gguf_path, device=torch.device("cuda")) == "fp32"
    assert choice(gguf_path, dtype=torch.bfloat16) == "fp32"
    kernels(False)
    assert choice(gguf_path) == "fp32"


def test_an_explicit_format_wins(kernels, gguf_path):
    assert choice(gguf_path, "fp32") == "fp32"
    kernels(False)
    assert choice(gguf_path, "gguf") == "gguf"  # then slow (the fallback), but asked for


def test_apply_quantization_leaves_a_dense_choice_alone_and_logs_it(tmp_path, caplog):
    model = torch.nn.Linear(4, 4)
    with caplog.at_level(logging.INFO, logger="vllm.model_executor.model_loader"):
        assert apply_quantization(model, ModelConfig(model=str(tmp_path))) == "fp32"
    assert "Quantization: fp32 (auto: not a .gguf model)" in caplog.text
    assert type(model) is torch.nn.Linear


@pytest.mark.slow
@pytest.mark.parametrize(("quantization", "expected"), [(None, "gguf"), ("fp32", "fp32")])
def test_the_embedded_model_is_served_quantized_unless_fp32_is_asked(quantization, expected):
    from vllm.model_executor.layers.quantization.gguf import GGUFLinear

    if not ops.ensure_quant_kernels():
        pytest.skip("the native kernels cannot be built here")
    runner = load_cpu_runner(ModelConfig(quantization=quantization))
    quantized = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert bool(quantized) == (expected == "gguf")
