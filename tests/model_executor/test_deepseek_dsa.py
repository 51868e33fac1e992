"""DeepSeek-V3.2 and GLM-5 (``models/deepseek_dsa.py``): V3's latent attention plus DSA's
lightning indexer. Tiny checkpoints written by transformers, with an ``index_topk`` far
below the contexts so that the indexer's choice matters: fp32 logits equal transformers',
through the sparse path (counted), and differ from attending densely; contexts within
``index_topk`` take the backend's dense path; the engine's greedy tokens (chunked prefill,
batched decodes, a prefix hit) equal transformers' ``generate``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from tests.tiny_models import check_engine_greedy_matches, load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.models import deepseek_dsa
from vllm.model_executor.models.deepseek_dsa import (
    DeepseekDsaArch,
    DeepseekV32ForCausalLM,
    DsaAttention,
    GlmMoeDsaForCausalLM,
)
from vllm.model_executor.models.registry import ModelRegistry

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8,
            num_experts_per_tok=2, kv_lora_rank=56, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=128, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1, index_topk=8,
            index_head_dim=16, index_n_heads=8)  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}  # fmt: skip
VARIANTS = {
    # DeepSeek-V3.2: every layer indexes (Neox-paired index rotation), yarn.
    "v32": ("DeepseekV32", dict(rope_parameters=YARN, routed_scaling_factor=2.5)),
    # GLM-5: the middle layer reuses layer 0's top-k; adjacent-pair index rotation.
    "glm5": ("GlmMoeDsa", dict(indexer_types=["full", "shared", "full"], n_group=1,
                               topk_group=1, rms_norm_eps=1e-5)),
}  # fmt: skip
CLASSES = {"v32": DeepseekV32ForCausalLM, "glm5": GlmMoeDsaForCausalLM}


def save(name: str, path, **overrides) -> torch.nn.Module:
    family, fields = VARIANTS[name]
    config = getattr(transformers, f"{family}Config")(**{**TINY, **fields, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms away from 1 (k_norm's bias from 0), a routing bias
        for param_name, p in [*model.named_parameters(), *model.named_buffers()]:
            if param_name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif param_name.endswith("k_norm.bias"):
                p.normal_(0.0, 0.5)
            elif param_name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


def hf_logits(hf, ids: torch.Tensor, index_topk: int | None = None) -> torch.Tensor:
    """transformers' logits; ``index_topk``: with its indexers keeping that many."""
    indexers = [m for m in hf.modules() if hasattr(m, "index_topk")]
    saved = [m.index_topk for m in indexers]
    for m in indexers:
        m.index_topk = index_topk or m.index_topk
    try:
        with torch.inference_mode():
            return hf(ids[None]).logits[0].float()
    finally:
        for m, k in zip(indexers, saved, strict=True):
            m.index_topk = k


def test_dsa_architectures_resolve():
    for name, cls in CLASSES.items():
        family, fields = VARIANTS[name]
        config = getattr(transformers, f"{family}Config")(**{**TINY, **fields})
        assert ModelRegistry.resolve_model_cls(config)[0] is cls
    # GLM-5's released config names its pairing and an MTP option: accepted.
    for field, value in (
        ("indexer_rope_interleave", True),
        ("index_share_for_mtp_iteration", True),
    ):
        object.__setattr__(config, field, value)
    assert DeepseekDsaArch.from_hf(config).index_rope_interleave


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dsa_sparse_logits_equal_transformers(name, tmp_path):
    """48 tokens, top 8: the sparse path (every layer's call counted) gives transformers'
    logits, which attending to every causal token does not."""
    hf = save(name, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a = runner.arch
    # The cache row: [c_kv | k_pe | index key]; values the first kv_lora_rank dims.
    assert (a.num_kv_heads, a.head_dim, a.latent_value_size) == (1, 56 + 8 + 16, 56)
    assert a.indexer_layers == ((0, 2) if name == "glm5" else (0, 1, 2))
    assert a.sparse_layers == (1, 2) and a.topk_method == "noaux_tc"
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(a.softmax_scale, rel=1e-12)
    ids = torch.randint(0, TINY["vocab_size"], (48,), generator=torch.Generator().manual_seed(1))
    before = DsaAttention.sparse_calls
    ours = runner_logits(runner, ids)
    assert DsaAttention.sparse_calls - before == 3  # every layer attended sparsely
    assert runner.kv_caches[0].shape == (1, 9, 16, 1, a.head_dim)
    ref = hf_logits(hf, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    dense = hf_logits(hf, ids, index_topk=1000)
    assert (dense - ref).abs().max() > 1e-2  # the selection matters at this top-k
    # The rows of the first 8 positions see every earlier token either way.
    assert torch.allclose(dense[:8], ref[:8], atol=1e-4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dsa_dense_path_when_contexts_fit(name, tmp_path):
    """index_topk 64 over 40 tokens keeps every causal token: the backend attends densely
    (no sparse call), equal to transformers."""
    hf = save(name, tmp_path, index_topk=64)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    ids = torch.randint(0, TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(2))
    before = DsaAttention.sparse_calls
    ours = runner_logits(runner, ids)
    assert DsaAttention.sparse_calls == before
    ref = hf_logits(hf, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("name, budget", [("v32", None), ("glm5", None), ("v32", 500)])
def test_dsa_mixed_step_logits_equal_transformers(name, budget, tmp_path, monkeypatch):
    """Three requests prefilled (6, 30 and 20 tokens), then one step of two decodes (a
    context of 7, within top 8, and one of 31) and a 10-token chunk over C's cached 20:
    every row's logits equal transformers' at its position. ``budget``: the score
    elements a block may hold, so small that the queries go a few at a time."""
    if budget is not None:
        monkeypatch.setattr(deepseek_dsa, "SCORE_BUDGET", budget)
    hf = save(name, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    runner.initialize_kv_cache(8)
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, TINY["vocab_size"], (n,), generator=g) for n in (7, 31, 30)]
    tables = [[1], [2, 3], [4, 5]]
    refs = [hf_logits(hf, s) for s in seqs]

    def step(layout, spans):
        ids = torch.cat([seqs[i][a:b] for i, (a, b) in spans])
        positions = torch.cat([torch.arange(a, b) for _, (a, b) in spans])
        meta = runner.metadata_builder.build_metadata(layout)
        with torch.inference_mode():
            ours = runner.model.compute_logits(runner.model(ids, positions, meta, runner.kv_caches))
        ref = torch.cat([refs[i][a:b] for i, (a, b) in spans])
        assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()

    step([(0, 6, tables[0]), (0, 30, tables[1]), (0, 20, tables[2])],
         [(0, (0, 6)), (1, (0, 30)), (2, (0, 20))])  # fmt: skip
    before = DsaAttention.sparse_calls
    step([(6, 1, tables[0]), (30, 1, tables[1]), (20, 10, tables[2])],
         [(0, (6, 7)), (1, (30, 31)), (2, (20, 30))])  # fmt: skip
    assert DsaAttention.sparse_calls - before == 3


def test_index_rotation_pairing_is_live(tmp_path):
    """DeepSeek-V3.2's indexer pairs halves (Neox): pairing adjacent dims instead (GLM-5's)
    moves the selection and the logits away from transformers'."""
    from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

    hf = save("v32", tmp_path)
    arch = DeepseekDsaArch.from_hf(hf.config)
    assert not arch.index_rope_interleave
    model = DeepseekV32ForCausalLM(dataclasses.replace(arch, index_rope_interleave=True))
    model.load_weights(hf.state_dict())
    backend = TorchSDPABackend(
        4, 1, arch.head_dim, torch.float32, "cpu", 16, value_size=arch.latent_value_size
    )
    model.set_attention_backend(backend)
    caches = [torch.zeros(backend.kv_cache_shape(9)) for _ in model.layers]
    ids = torch.arange(48) % TINY["vocab_size"]
    meta = backend.build_metadata([(0, 48, list(range(1, 9)))])
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, torch.arange(48), meta, caches))
    assert (ours - hf_logits(hf, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(VARIANTS))
def test_dsa_engine_greedy_tokens_equal_transformers_generate(name, tmp_path):
    """Top 12 of contexts of 43 to 80 tokens: 16-token chunks over a cached prefix, batched
    decodes of different lengths and a prefix hit, all sparse. Weights 5x transformers'
    initial spread (V3's engine test)."""
    hf = save(name, tmp_path, vocab_size=49152, max_position_embeddings=256,
              initializer_range=0.1, index_topk=12)  # fmt: skip
    before = DsaAttention.sparse_calls
    check_engine_greedy_matches(hf, tmp_path)
    assert DsaAttention.sparse_calls > before


def test_non_sdpa_backend_is_refused(tmp_path):
    hf = save("glm5", tmp_path)
    model = GlmMoeDsaForCausalLM(DeepseekDsaArch.from_hf(hf.config))

    class Other:
        name = "TRITON_MLA"

    with pytest.raises(ValueError, match="TRITON_MLA.*--attention-backend TORCH_SDPA"):
        model.set_attention_backend(Other())


def test_the_selector_picks_the_backend_whose_metadata_is_read(tmp_path):
    """The model asks for ``indexed_reads``: no backend but TORCH_SDPA lists it, so CUDA's
    default latent backend (TRITON_MLA) is passed over without a flag."""
    from vllm.v1.attention.backends.registry import backend_names, get_backend_class

    hf = save("glm5", tmp_path)
    features = GlmMoeDsaForCausalLM(DeepseekDsaArch.from_hf(hf.config)).attention_features
    assert "indexed_reads" in features
    serving = [
        n for n in backend_names() if not get_backend_class(n).unsupported_features(features)
    ]
    assert serving == ["TORCH_SDPA"]
    assert get_backend_class("TRITON_MLA").unsupported_features(frozenset({"latent_kv"})) == []


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("DeepseekV32", dict(q_lora_rank=None), "q_lora_rank"),
        ("DeepseekV32", dict(index_head_dim=4), "index_head_dim 4"),
        ("GlmMoeDsa", dict(indexer_types=["shared", "full", "full"]), "indexer_types"),
        ("DeepseekV32", dict(topk_method="greedy"), "topk_method 'greedy'"),
        ("DeepseekV32", dict(index_fp8_scale="ue8m0"), "index_fp8_scale"),
        ("GlmMoeDsa", dict(index_kpool=4), "index_kpool"),
        ("GlmMoeDsa", dict(indexer_rope_interleave=False), "indexer_rope_interleave False"),
        ("DeepseekV32", dict(rope_interleave=False), "rope_interleave False"),
        ("DeepseekV32", dict(quantization_config={"quant_method": "gptq"}), "quantization"),
    ],
)
def test_unsupported_configs_are_refused(family, overrides, message):
    config = getattr(transformers, f"{family}Config")(**TINY)
    for field, value in overrides.items():  # past the config's own checks
        object.__setattr__(config, field, value)
    with pytest.raises(ValueError, match=message):
        DeepseekDsaArch.from_hf(config)
