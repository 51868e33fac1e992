"""DeepSeek-V2 and V3 (``models/deepseek_v2.py``): multi-head latent attention run as
multi-query attention over the cached latent, and DeepSeek's routings. Tiny checkpoints
written by transformers give its fp32 logits, and the engine's greedy tokens (chunked
prefill, batched decodes, a prefix hit) equal its ``generate``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from tests.tiny_models import check_engine_greedy_matches, load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2Arch,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
)
from vllm.model_executor.models.moe import select_experts_group_limited
from vllm.model_executor.models.registry import ModelRegistry

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, kv_lora_rank=56, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=128)  # fmt: skip
# yarn with DeepSeek's mscale_all_dim: the softmax scale grows by mscale(4, 0.707) ** 2.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}  # fmt: skip
VARIANTS = {
    # V2-Lite's shape: q straight from the hidden state, greedy softmax routing, a dense
    # first layer, two shared experts.
    "v2_lite": ("DeepseekV2", dict(q_lora_rank=None, first_k_dense_replace=1,
                                   n_shared_experts=2, topk_method="greedy")),
    # V2: q through its low-rank pair, routing limited to the best 2 of 4 groups, scaled,
    # yarn.
    "v2_grouped": ("DeepseekV2", dict(topk_method="group_limited_greedy", n_group=4,
                                      topk_group=2, routed_scaling_factor=1.7,
                                      n_shared_experts=1, rope_parameters=YARN)),
    # V3: the real latent width (512 + 64 = 576), noaux_tc sigmoid routing with a
    # correction bias in the best 2 of 4 groups, renormalised and scaled, yarn, pairs
    # interleaved.
    "v3": ("DeepseekV3", dict(kv_lora_rank=512, qk_rope_head_dim=64, n_group=4, topk_group=2,
                              n_shared_experts=1, first_k_dense_replace=1,
                              routed_scaling_factor=2.5, rope_parameters=YARN)),
    # V3 with the Neox rotation (rope_interleave false), every layer sparse.
    "v3_neox": ("DeepseekV3", dict(rope_interleave=False, n_group=2, topk_group=1,
                                   n_shared_experts=1, first_k_dense_replace=0)),
}  # fmt: skip


def save(name: str, path, **overrides) -> torch.nn.Module:
    family, fields = VARIANTS[name]
    config = getattr(transformers, f"{family}Config")(**{**TINY, **fields, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms away from 1, a routing bias that chooses
        for param_name, p in [*model.named_parameters(), *model.named_buffers()]:
            if param_name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif param_name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def test_deepseek_architectures_resolve():
    for name, cls in (("v2_lite", DeepseekV2ForCausalLM), ("v3", DeepseekV3ForCausalLM)):
        family, fields = VARIANTS[name]
        config = getattr(transformers, f"{family}Config")(**{**TINY, **fields})
        assert ModelRegistry.resolve_model_cls(config)[0] is cls


@pytest.mark.parametrize("name", list(VARIANTS))
def test_deepseek_logits_equal_transformers(name, tmp_path):
    hf = save(name, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a, fields = runner.arch, VARIANTS[name][1]
    # The cache holds one latent "head" per token, [c_kv | k_pe], and no V half: a value is
    # the key's first kv_lora_rank dims.
    latent = fields.get("kv_lora_rank", TINY["kv_lora_rank"])
    assert (a.num_kv_heads, a.head_dim) == (1, latent + fields.get("qk_rope_head_dim", 8))
    assert a.latent_value_size == latent and runner.attn_backend.value_size == latent
    first_sparse = fields.get("first_k_dense_replace", 0)
    assert [layer.mlp.__class__.__name__ for layer in runner.model.layers] == [
        "DeepseekMoE" if i >= first_sparse else "DenseMLP" for i in range(3)
    ]
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(a.softmax_scale, rel=1e-12)
    ids = torch.randint(0, TINY["vocab_size"], (100,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)
    ref = hf_logits(hf, ids)
    assert runner.kv_caches[0].shape == (1, 9, 16, 1, a.head_dim)
    # Half of what K and V halves of the latent's width took per block.
    assert runner.get_kv_cache_bytes_per_block() == 3 * 16 * a.head_dim * 4
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("change", ["softmax_scale", "rope_interleave", "routed_scaling_factor"])
def test_each_arch_field_is_live(change, tmp_path):
    """Changing one field of our arch moves the logits away from transformers' (so a model
    that ignored the config's value would fail the test above)."""
    from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

    hf = save("v2_grouped", tmp_path)
    arch = DeepseekV2Arch.from_hf(hf.config)
    # The scale without yarn's mscale, the Neox rotation, the routing unscaled.
    value = {"softmax_scale": arch.qk_head_dim**-0.5, "rope_interleave": False,
             "routed_scaling_factor": 1.0}[change]  # fmt: skip
    arch = dataclasses.replace(arch, **{change: value})
    assert getattr(arch, change) != getattr(DeepseekV2Arch.from_hf(hf.config), change)
    model = DeepseekV2ForCausalLM(arch)
    model.load_weights(hf.state_dict())
    backend = TorchSDPABackend(
        4, 1, arch.head_dim, torch.float32, "cpu", 16, value_size=arch.latent_value_size
    )
    model.set_attention_backend(backend)
    caches = [torch.zeros(backend.kv_cache_shape(9)) for _ in model.layers]
    ids = torch.arange(60) % TINY["vocab_size"]
    meta = backend.build_metadata([(0, 60, list(range(1, 9)))])
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, torch.arange(60), meta, caches))
    assert (ours - hf_logits(hf, ids)).abs().max() > 1e-3


def test_group_limited_routing_keeps_to_the_best_groups():
    """4 experts in 2 groups, ranked by their best probability: group 0 (0.4) beats group 1
    (0.3, though its sum is larger), so with one group kept the second choice is expert 1
    (0.05), not expert 3 (0.3)."""
    probs = torch.tensor([[0.4, 0.05, 0.25, 0.3]])
    weights, ids = select_experts_group_limited(probs.log(), 2, 2, 1, False, 2.0)
    assert ids.tolist() == [[0, 1]]
    assert torch.allclose(weights, torch.tensor([[0.8, 0.1]]))
    weights, ids = select_experts_group_limited(probs.log(), 2, 1, 1, True, 1.0)
    assert ids.tolist() == [[0, 3]] and torch.allclose(weights, torch.tensor([[4 / 7, 3 / 7]]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(topk_method="noaux_tc"), "topk_method 'noaux_tc' with scoring_func 'softmax'"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(n_group=3, topk_group=1, topk_method="group_limited_greedy"), "n_group 3"),
        (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    ],
)
def test_unsupported_configs_are_refused(overrides, message):
    config = transformers.DeepseekV2Config(**{**TINY, **overrides})
    with pytest.raises(ValueError, match=message):
        DeepseekV2Arch.from_hf(config)


@pytest.mark.parametrize("name", ["v2_grouped", "v3"])
def test_deepseek_engine_greedy_tokens_equal_transformers_generate(name, tmp_path):
    """Chunked prefill (16-token chunks), batched decodes and a prefix hit through the
    latent cache. Weights 5x transformers' initial spread: at its own, V3's greedy tokens
    barely depend on the rotated key part (a model rotating every token at position 0
    passed)."""
    hf = save(name, tmp_path, vocab_size=49152, max_position_embeddings=256, initializer_range=0.1)
    check_engine_greedy_matches(hf, tmp_path)


def test_deepseek_fp8_latent_cache(tmp_path):
    """--kv-cache-dtype fp8: the one latent row a token in one byte a value (a quarter of
    fp32's bytes per block), read back by TORCH_SDPA's latent paths; the logits stay near
    transformers' (the rows rounded to 3 mantissa bits)."""
    from vllm.config import CacheConfig, VllmConfig

    hf = save("v2_lite", tmp_path)
    config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path), max_model_len=128),
        cache_config=CacheConfig(block_size=16, cache_dtype="fp8"),
    )
    runner = load_cpu_runner(config)
    a = runner.arch
    assert runner.get_kv_cache_bytes_per_block() == 3 * 16 * a.head_dim
    ids = torch.randint(0, TINY["vocab_size"], (100,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)
    assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
    assert runner.kv_caches[0].shape == (1, 9, 16, 1, a.head_dim)
    ref = hf_logits(hf, ids)
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
