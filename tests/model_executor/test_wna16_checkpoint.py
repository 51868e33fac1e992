"""Integer-weight checkpoints (``layers/quantization/wna16_checkpoint.py``): tiny AWQ, GPTQ
and compressed-tensors pack-quantized checkpoints of a Llama and a Qwen3-MoE
(``wna16_checkpoints.py``) give the logits of transformers' model of their dequantized
weights (fp32, 1e-4); the engine's greedy tokens equal ``generate``; configs not
implemented are refused naming their field."""

from __future__ import annotations

import json

import pytest
import torch

from tests.model_executor.wna16_checkpoints import (
    IDS,
    SCHEMES,
    hf_logits,
    save_model,
    write_wna16_checkpoint,
)
from tests.tiny_models import check_engine_greedy_matches, load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.layers.quantization.wna16_checkpoint import (
    WNA16CheckpointFormat,
    pop_quantized_weights,
    prepare_wna16_state,
)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_wna16_checkpoint_gives_the_dequantized_models_logits(family, scheme, tmp_path):
    reference = write_wna16_checkpoint(save_model(family), tmp_path, scheme)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    ours = runner_logits(runner, IDS)
    ref = hf_logits(reference, IDS)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize(
    "family, scheme", [("llama", "awq_g32"), ("qwen3_moe", "gptq4_asym_act_order"),
                       ("llama", "ct_w4_channel_asym")],
)  # fmt: skip
def test_engine_greedy_tokens_equal_the_dequantized_models_generate(family, scheme, tmp_path):
    hf = save_model(family, vocab_size=49152, max_position_embeddings=256)
    reference = write_wna16_checkpoint(hf, tmp_path, scheme)
    check_engine_greedy_matches(reference, tmp_path, max_tokens=6)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_each_dequantized_weight_equals_the_written_values(scheme, tmp_path):
    """Weight by weight, not only through logits a wrong nibble order might still pass."""
    from safetensors.torch import load_file

    write_wna16_checkpoint(save_model("llama"), tmp_path, scheme)
    state = load_file(tmp_path / "model.safetensors")
    dense = load_file(tmp_path / "dequantized" / "model.safetensors")
    fmt = WNA16CheckpointFormat.from_config(SCHEMES[scheme][0])
    assert prepare_wna16_state(state, fmt, torch.float32) == 14  # 7 linears x 2 layers
    assert state.keys() == dense.keys()
    for name, w in dense.items():
        assert torch.equal(state[name], w), name


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_stored_weight_knows_its_dense_shape_before_it_is_read(scheme, tmp_path):
    from safetensors.torch import load_file

    write_wna16_checkpoint(save_model("llama"), tmp_path, scheme)
    state = load_file(tmp_path / "model.safetensors")
    dense = load_file(tmp_path / "dequantized" / "model.safetensors")
    fmt = WNA16CheckpointFormat.from_config(SCHEMES[scheme][0])
    for name, stored in pop_quantized_weights(state, fmt).items():
        assert stored.shape == dense[name].shape == stored.read().q.shape, name


def _rewrite_config(path, **changes) -> None:
    with open(path / "config.json") as f:
        saved = json.load(f)
    saved["quantization_config"].update(changes)
    with open(path / "config.json", "w") as f:
        json.dump(saved, f)


BAD_CONFIGS = [
    ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
     "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*": {}}}, "dynamic"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "some_new_field": 1},
     "some_new_field"),
]  # fmt: skip


@pytest.mark.parametrize("config, field", BAD_CONFIGS)
def test_configs_not_implemented_are_refused_naming_the_field(config, field):
    with pytest.raises(ValueError, match=f"quantization_config.{field} "):
        WNA16CheckpointFormat.from_config(config)


def test_compressed_tensors_refusals_name_the_field():
    cfg = SCHEMES["ct_w4_g64_sym"][0]
    group = cfg["config_groups"]["group_0"]
    bad = [
        ({"weights": {**group["weights"], "num_bits": 2}}, "weights.num_bits"),
        ({"weights": {**group["weights"], "strategy": "tensor"}}, "weights.strategy"),
        ({"weights": {**group["weights"], "type": "float"}}, "weights.type"),
        ({"input_activations": {"num_bits": 8, "type": "int"}}, "input_activations"),
    ]
    for change, field in bad:
        config = {**cfg, "config_groups": {"group_0": {**group, **change}}}
        with pytest.raises(ValueError, match=f"config_groups.group_0.{field} "):
            WNA16CheckpointFormat.from_config(config)
    # float-quantized compressed-tensors is the FP8 reader's
    fp8 = {**cfg, "format": "float-quantized",
           "config_groups": {"group_0": {**group, "format": "float-quantized"}}}  # fmt: skip
    assert WNA16CheckpointFormat.from_config(fp8) is None


def test_missing_or_stray_tensors_are_errors(tmp_path):
    from safetensors.torch import load_file

    write_wna16_checkpoint(save_model("llama"), tmp_path, "gptq4_sym_g32")
    fmt = WNA16CheckpointFormat.from_config(SCHEMES["gptq4_sym_g32"][0])
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.0.self_attn.q_proj.scales"]
    with pytest.raises(ValueError, match="q_proj.scales is missing"):
        prepare_wna16_state(state, fmt, torch.float32)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.0.self_attn.q_proj.qweight"]
    with pytest.raises(ValueError, match="without its qweight"):
        prepare_wna16_state(state, fmt, torch.float32)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.scales"] = state[
        "model.layers.0.self_attn.q_proj.scales"
    ][:1]
    with pytest.raises(ValueError, match="q_proj.qweight: scales"):
        prepare_wna16_state(state, fmt, torch.float32)
    state = load_file(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no quantization_config"):
        prepare_wna16_state(state, None, torch.float32)


def test_an_unsupported_checkpoint_is_refused_at_load(tmp_path):
    write_wna16_checkpoint(save_model("llama"), tmp_path, "awq_g32")
    _rewrite_config(tmp_path, version="gemv_fast")
    with pytest.raises(ValueError, match="quantization_config.version 'gemv_fast'"):
        load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))


def test_quantization_fp8_refuses_to_requantize_a_4_bit_checkpoint(tmp_path):
    write_wna16_checkpoint(save_model("llama"), tmp_path, "awq_g32")
    config = ModelConfig(model=str(tmp_path), max_model_len=128, quantization="fp8")
    with pytest.raises(ValueError, match="re-quantizing them to FP8"):
        load_cpu_runner(config)


def test_quantization_awq_and_gptq_name_the_checkpoints_method(tmp_path):
    """vLLM's --quantization awq / gptq: the checkpoint's own method (here on CPU: served
    dequantized, the dequantized model's logits); any other checkpoint is an error."""
    reference = write_wna16_checkpoint(save_model("llama"), tmp_path / "awq", "awq_g32")
    runner = load_cpu_runner(
        ModelConfig(model=str(tmp_path / "awq"), max_model_len=128, quantization="awq")
    )
    ours, ref = runner_logits(runner, IDS), hf_logits(reference, IDS)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    with pytest.raises(ValueError, match="this checkpoint's is 'awq'"):
        load_cpu_runner(
            ModelConfig(model=str(tmp_path / "awq"), max_model_len=128, quantization="gptq")
        )
    save_model("llama").save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="this checkpoint's is none"):
        load_cpu_runner(
            ModelConfig(model=str(tmp_path / "dense"), max_model_len=128, quantization="awq")
        )
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(model=str(tmp_path / "awq"), quantization="gptq", load_format="dummy")
