"""``Fp8Linear`` (layers/quantization/fp8.py) on its own: its product against the formula,
each activation scheme, fbgemm's absmax cap, dtypes kept by ``Module.to``, no host sync in
the forward (CUDA graphs); the FP8 checkpoint configs and tensors that are refused, each
with a ValueError naming what."""

from __future__ import annotations

import pytest
import torch

from tests.model_executor.fp8_checkpoints import SCHEMES, write_fp8_checkpoint
from tests.tiny_models import load_cpu_runner, save_tiny_llama
from tests.v1.worker.test_no_host_sync import HostSyncGuard
from vllm.config import ModelConfig
from vllm.model_executor.layers.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    quantize_model_fp8,
)
from vllm.model_executor.layers.quantization.fp8_checkpoint import Fp8CheckpointFormat


def _layer(activation: str = "token", bias: bool = True, **kwargs) -> Fp8Linear:
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(48, 32, generator=g) * 100).to(FP8_DTYPE)
    scale = torch.rand(48, generator=g) * 0.01 + 0.001
    b = torch.randn(48, generator=g) if bias else None
    return Fp8Linear(weight, scale, b, activation, **kwargs)


def _expected(layer: Fp8Linear, x: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
    """x quantized by ``x_scale`` (rows, 1), times the dequantized weight, plus the bias."""
    q = (x / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * x_scale
    w = layer.weight.float() * layer.weight_scale.reshape(-1, 1)
    return q @ w.t() + (0 if layer.bias is None else layer.bias)


def _close(y: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to fp32 rounding: 1e-5 of each row's largest output."""
    return bool(((y - expected).abs() <= 1e-5 * expected.abs().amax(-1, keepdim=True)).all())


def test_token_activations_are_scaled_by_their_row_absmax():
    layer = _layer()
    x = torch.randn(5, 32) * torch.tensor([0.01, 1.0, 10.0, 100.0, 1000.0])[:, None]
    expected = _expected(layer, x, x.abs().amax(dim=1, keepdim=True) / FP8_MAX)
    assert _close(layer(x), expected)
    assert layer(x[None]).shape == (1, 5, 48)


def test_tensor_and_static_activation_scales():
    x = torch.randn(5, 32) * torch.tensor([0.01, 1.0, 10.0, 100.0, 1000.0])[:, None]
    tensor = _layer("tensor")
    whole = torch.full((5, 1), float(x.abs().amax() / FP8_MAX))
    assert _close(tensor(x), _expected(tensor, x, whole))
    static = _layer("static", input_scale=torch.tensor(0.5))
    assert _close(static(x), _expected(static, x, torch.full((5, 1), 0.5)))


def test_fbgemm_activation_scale_ub_caps_the_row_absmax():
    layer = _layer(activation_scale_ub=50.0)
    x = torch.randn(3, 32) * torch.tensor([1.0, 100.0, 1000.0])[:, None]
    cap = x.abs().amax(dim=1, keepdim=True).clamp(max=50.0) / FP8_MAX
    assert _close(layer(x), _expected(layer, x, cap))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_in_the_input_dtype_and_module_to_keeps_fp8(dtype):
    layer = _layer().to(dtype)
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == dtype
    assert layer(torch.randn(4, 32, dtype=dtype)).dtype == dtype


def test_quantize_model_fp8_scales_each_output_channel_by_its_absmax():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    model.lm_head = torch.nn.Linear(16, 8)
    dense = [m.weight.detach().clone() for m in model[:2]]
    assert quantize_model_fp8(model) == 2
    assert isinstance(model[0], Fp8Linear) and type(model.lm_head) is torch.nn.Linear
    for layer, w in zip(model[:2], dense, strict=True):
        assert torch.equal(layer.weight_scale.flatten(), w.abs().amax(dim=1) / FP8_MAX)
        assert layer.weight.float().abs().amax(dim=1).eq(FP8_MAX).all()


@pytest.mark.parametrize("activation", ["token", "tensor", "static"])
def test_fp8_linear_has_no_host_sync(activation):
    layer = _layer(activation, input_scale=torch.tensor(0.5) if activation == "static" else None)
    x = torch.randn(7, 32)
    with torch.inference_mode(), HostSyncGuard():
        y = layer(x)
    assert y.shape == (7, 48)


@pytest.mark.cuda
def test_fp8_linear_on_cuda_equals_the_formula():
    from vllm.model_executor.layers.quantization.fp8 import fp8_supported

    if not fp8_supported("cuda")[0]:
        pytest.skip(fp8_supported("cuda")[1])
    layer = _layer().cuda()
    x = torch.randn(20, 32, device="cuda", dtype=torch.bfloat16)
    expected = _expected(layer, x.float(), x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX)
    assert torch.allclose(layer(x).float(), expected, rtol=2e-2, atol=2e-2)
    graph = torch.cuda.CUDAGraph()
    static_out = layer(x)
    with torch.cuda.graph(graph):
        static_out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, layer(x))


CT_GROUP = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": True}}  # fmt: skip


def _ct(**group) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": {"g": {**CT_GROUP, **group}}}


@pytest.mark.parametrize(
    "config, message",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'"),
        ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt"),
        ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
         "activation_scheme"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "fp8", "modules_to_convert": ["embed_tokens"]}, "modules_to_convert"),
        ({"quant_method": "fp8", "some_new_field": 1}, "some_new_field"),
        ({"quant_method": "fbgemm_fp8", "extra": True}, "extra"),
        ({**_ct(), "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config"),
        ({**_ct(), "format": "pack-quantized"}, "format"),
        (_ct(weights={"num_bits": 4, "type": "int"}), r"weights\.num_bits"),
        (_ct(weights={"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}),
         r"weights\.group_size"),
        (_ct(input_activations={"num_bits": 8, "type": "float", "strategy": "token",
                                "dynamic": False}), "input_activations"),
        ({"quant_method": "compressed-tensors", "config_groups": {"a": CT_GROUP, "b": CT_GROUP}},
         "config_groups"),
    ],
)  # fmt: skip
def test_unsupported_quantization_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        Fp8CheckpointFormat.from_config(config)


def test_supported_configs_read_their_activation_schemes():
    read = Fp8CheckpointFormat.from_config
    assert read(SCHEMES["fp8_block"][0]).block_size == (64, 64)
    assert read(SCHEMES["fp8_tensor_static"][0]).activation == "static"
    assert read(SCHEMES["ct_tensor_static"][0]).activation == "static"
    assert read(SCHEMES["ct_channel_dynamic"][0]).activation == "token"
    assert read(SCHEMES["fbgemm"][0]).activation_scale_ub == 1200.0
    assert read(_ct(input_activations=None)).activation is None  # weight-only
    # An FP8 KV-cache scheme (read by kv_scales.py) beside FP8 weights, or alone.
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
    assert read({**_ct(), "kv_cache_scheme": kv}).activation == "token"
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {}, "kv_cache_scheme": kv}
    assert read(kv_only) is None  # dense weights
    assert read({"quant_method": "mxfp4"}) is None  # gpt-oss reads its own


def test_fp8_tensors_without_a_config_or_a_scale_are_refused(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from tests.model_executor.test_fp8 import save_model

    write_fp8_checkpoint(save_model("llama"), tmp_path, "fbgemm")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no FP8 quantization_config"):
        load_cpu_runner(ModelConfig(model=str(tmp_path)))
    write_fp8_checkpoint(save_model("llama"), tmp_path, "fbgemm")
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        load_cpu_runner(ModelConfig(model=str(tmp_path)))
    state["model.layers.1.mlp.down_proj.weight_scale"] = torch.ones(64, 1)
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 96)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"down_proj\.weight_scale: a scale for a weight"):
        load_cpu_runner(ModelConfig(model=str(tmp_path)))


def test_a_dense_model_with_another_quantization_config_is_refused(tmp_path):
    import json

    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'"):
        load_cpu_runner(ModelConfig(model=str(tmp_path)))


def test_quantization_field_takes_fp8():
    assert ModelConfig(quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int4")
