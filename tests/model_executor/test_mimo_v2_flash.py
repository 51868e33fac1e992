"""MiMo-V2-Flash (``models/mimo_v2_flash.py``): hybrid sliding-window / full attention
layers (the sliding ones with twice the KV heads and attention sinks), q/k heads wider
than the values, scaled values, partial rotation by each layer type's theta, sigmoid
routing with a correction bias, dense and MoE layers. A tiny checkpoint written by
transformers gives its fp32 logits, and the engine's greedy tokens (chunked prefill,
batched decodes, a prefix hit) equal its ``generate``."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.tiny_models import check_engine_greedy_matches, load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.models.mimo_v2_flash import MiMoV2FlashArch, MiMoV2FlashForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

# A window of 20 positions (the contexts: 100 tokens); 8 of the 24 q/k dims rotated
# (transformers' default factor 0.334), values 16 wide; 8 experts in 2 groups, 1 kept.
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=24,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, routed_scaling_factor=1.5, sliding_window=20,
            max_position_embeddings=128, attention_value_scale=0.707,
            layer_types=["full_attention", "sliding_attention", "sliding_attention",
                         "full_attention"],
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 1e4}})  # fmt: skip


def save(path, **overrides) -> torch.nn.Module:
    config = transformers.MiMoV2FlashConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.MiMoV2FlashForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1; sinks, biases and routing bias that matter
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("e_score_correction_bias", "sinks", "proj.bias")):
                p.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model


def test_mimo_v2_flash_resolves_and_reads_its_config():
    config = transformers.MiMoV2FlashConfig(**TINY)
    assert ModelRegistry.resolve_model_cls(config)[0] is MiMoV2FlashForCausalLM
    a = MiMoV2FlashArch.from_hf(config)
    assert (a.num_kv_heads, a.full_kv_heads, a.head_dim, a.v_head_dim) == (2, 1, 24, 16)
    assert a.sliding_windows == (None, 20, 20, None) and a.sparse_layers == (1, 3)
    assert a.rope_parameters["partial_rotary_factor"] == 0.334
    assert a.rope_local_parameters["rope_theta"] == 1e4 and a.rope_theta == 5e5
    assert a.value_scale == 0.707 and a.scoring == "sigmoid"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(layer_types=["full_attention", "chunked_attention", "sliding_attention",
                           "full_attention"]), "layer_types"),
        (dict(mlp_layer_types=["dense", "moe", "dense", "sparse"]), "mlp_layer_types"),
        (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 1e4},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 1e4}}), "rope_type"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope_parameters"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(n_group=3), "n_group 3"),
        (dict(swa_num_key_value_heads=4), "swa_num_key_value_heads"),
        (dict(v_head_dim=32), "v_head_dim 32"),
        (dict(add_full_attention_sink_bias=True), "add_full_attention_sink_bias"),
    ],
)  # fmt: skip
def test_unsupported_mimo_v2_flash_configs_are_refused(overrides, message):
    config = transformers.MiMoV2FlashConfig(**TINY)
    for k, v in overrides.items():  # past the config's own checks
        setattr(config, k, v)
    with pytest.raises(ValueError, match=message):
        MiMoV2FlashArch.from_hf(config)


@pytest.mark.parametrize("bias", [False, True])
def test_mimo_v2_flash_logits_equal_transformers(bias, tmp_path):
    hf = save(tmp_path, attention_bias=bias)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    model = runner.model
    assert isinstance(model, MiMoV2FlashForCausalLM)
    assert "sinks" in model.attention_features and "sliding_window" in model.attention_features
    assert [layer.sinks is not None for layer in model.layers] == [False, True, True, False]
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "NoneType",
        "MiMoV2FlashMoeBlock",
        "NoneType",
        "MiMoV2FlashMoeBlock",
    ]
    ids = torch.randint(0, TINY["vocab_size"], (100,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
        # The window, the sinks and the value scale each change transformers' logits.
        for field, value in (("sliding_window", 200), ("attention_value_scale", 1.0)):
            hf.config.__dict__[field] = value
            for layer in hf.model.layers:
                attn = layer.self_attn
                attn.sliding_window = hf.config.sliding_window if attn.sinks is not None else None
                attn.v_scale = hf.config.attention_value_scale
            other = hf(ids[None]).logits[0].float()
            assert (other - ref).abs().max() > 1e-2, field
            hf.config.__dict__[field] = TINY[field]
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_mimo_v2_flash_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """Chunked prefill (16-token chunks) past the 20-position window, batched decodes and
    a prefix hit, through the sliding and full layers' caches."""
    hf = save(tmp_path, vocab_size=49152, max_position_embeddings=256, initializer_range=0.1)
    check_engine_greedy_matches(hf, tmp_path)
