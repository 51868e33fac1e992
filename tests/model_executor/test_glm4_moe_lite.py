"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``, ``glm4_moe_lite``: ``models/deepseek_v2.py``):
DeepSeek-V3's latent attention and sigmoid routing with a correction bias, its MoE layers
named by ``mlp_layer_types``. A tiny checkpoint written by transformers gives its fp32
logits, and the engine's greedy tokens (chunked prefill, batched decodes, a prefix hit)
equal its ``generate``."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.tiny_models import check_engine_greedy_matches, load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.models.deepseek_v2 import DeepseekV2Arch, Glm4MoeLiteForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

# Dense, sparse, dense, sparse: not transformers' default (the first dense), so the
# pattern is read from mlp_layer_types. Experts in 4 groups, the best 2 kept; q through
# its low-rank pair; yarn with mscale_all_dim (the softmax scale grows).
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=4,
            topk_group=2, routed_scaling_factor=1.8, kv_lora_rank=56, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
            max_position_embeddings=128,
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            rope_parameters={"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32, "mscale": 1.0,
                             "mscale_all_dim": 0.707, "rope_theta": 10000.0})  # fmt: skip


def save(path, **overrides) -> torch.nn.Module:
    config = transformers.Glm4MoeLiteConfig(**{**TINY, **overrides})
    torch.manual_seed(0)
    model = transformers.Glm4MoeLiteForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, a routing bias that chooses
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


def test_glm4_moe_lite_resolves_and_reads_its_config():
    config = transformers.Glm4MoeLiteConfig(**TINY)
    assert ModelRegistry.resolve_model_cls(config)[0] is Glm4MoeLiteForCausalLM
    a = DeepseekV2Arch.from_hf(config)
    assert a.sparse_layers == (1, 3) and a.topk_method == "noaux_tc"
    assert (a.num_groups, a.topk_groups, a.norm_topk_prob) == (4, 2, True)
    assert a.rope_interleave and a.routed_scaling_factor == 1.8
    # transformers' default pattern: the first layer dense, the rest sparse, whatever
    # first_k_dense_replace says; GLM-4.5's router whatever topk_method says.
    default = {k: v for k, v in TINY.items() if k != "mlp_layer_types"}
    config = transformers.Glm4MoeLiteConfig(**default, first_k_dense_replace=3,
                                            topk_method="greedy")  # fmt: skip
    a = DeepseekV2Arch.from_hf(config)
    assert a.sparse_layers == (1, 2, 3) and a.topk_method == "noaux_tc"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mlp_layer_types=["dense", "moe", "dense", "sparse"]), "mlp_layer_types"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                               "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)  # fmt: skip
def test_unsupported_glm4_moe_lite_configs_are_refused(overrides, message):
    config = transformers.Glm4MoeLiteConfig(**TINY)
    for k, v in overrides.items():  # past the config's own checks
        setattr(config, k, v)
    with pytest.raises(ValueError, match=message):
        DeepseekV2Arch.from_hf(config)


@pytest.mark.parametrize("interleave", [True, False])
def test_glm4_moe_lite_logits_equal_transformers(interleave, tmp_path):
    hf = save(tmp_path, rope_interleave=interleave)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a = runner.arch
    assert isinstance(runner.model, Glm4MoeLiteForCausalLM)
    assert (a.num_kv_heads, a.head_dim, a.latent_value_size) == (1, 56 + 8, 56)
    assert [layer.mlp.__class__.__name__ for layer in runner.model.layers] == [
        "DenseMLP",
        "DeepseekMoE",
        "DenseMLP",
        "DeepseekMoE",
    ]
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(a.softmax_scale, rel=1e-12)
    ids = torch.randint(0, TINY["vocab_size"], (100,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_glm4_moe_lite_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """Chunked prefill (16-token chunks), batched decodes and a prefix hit through the
    latent cache; weights 5x transformers' initial spread, so that the tokens depend on
    positions."""
    hf = save(tmp_path, vocab_size=49152, max_position_embeddings=256, initializer_range=0.1)
    check_engine_greedy_matches(hf, tmp_path)
