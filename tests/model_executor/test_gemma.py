"""The Gemma family (``models/gemma.py``): tiny Gemma, Gemma 2 and Gemma 3 checkpoints
written by transformers give transformers' logits past their sliding windows (soft caps,
sandwich norms, q/k norms and Gemma 3's two rotations included), in fp32 and bf16; the
engine's greedy tokens (chunked prefill, batched decodes, a prefix hit) equal transformers'
``generate``."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.tiny_models import (
    TINY_LLAMA,
    check_engine_greedy_matches,
    load_cpu_runner,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.gemma import GemmaForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

TINY_GEMMA = {**TINY_LLAMA, "head_dim": 16, "tie_word_embeddings": True}
GEMMA = {
    "GemmaForCausalLM": dict(),
    "Gemma2ForCausalLM": dict(sliding_window=12, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=0.2),
    "Gemma3ForCausalLM": dict(sliding_window=12, query_pre_attn_scalar=24, num_hidden_layers=3,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"],
                              rope_parameters={
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 100.0},
                                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                     "rope_theta": 10000.0}}),
}  # fmt: skip


def gemma_config(arch: str, **overrides):
    name = arch.replace("ForCausalLM", "TextConfig" if arch.startswith("Gemma3") else "Config")
    return getattr(transformers, name)(**{**TINY_GEMMA, **GEMMA[arch], **overrides})


def save_checkpoint(arch: str, path, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(transformers, arch)(gemma_config(arch, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # transformers starts them at 0 (a scale of 1)
                p.uniform_(-0.5, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):  # scores past the cap
                p.mul_(30)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", list(GEMMA))
def test_gemma_architecture_resolves_to_the_gemma_implementation(arch):
    assert ModelRegistry.resolve_model_cls(gemma_config(arch))[0] is GemmaForCausalLM


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", list(GEMMA))
def test_gemma_checkpoint_logits_equal_transformers(arch, dtype, tmp_path):
    hf = save_checkpoint(arch, tmp_path).to(getattr(torch, dtype))
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128, dtype=dtype))
    a = runner.arch
    expected_windows = {
        "GemmaForCausalLM": (None, None),
        "Gemma2ForCausalLM": (12, None),
        "Gemma3ForCausalLM": (12, None, 12),
    }[arch]
    assert a.sliding_windows == expected_windows
    assert runner.attn_backend.name == "TORCH_SDPA"
    ids = torch.randint(
        0, TINY_GEMMA["vocab_size"], (100,), generator=torch.Generator().manual_seed(1)
    )
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    if dtype == "float32":
        assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    else:  # bf16 rounding along 2-3 layers: close, and the same greedy choice almost always
        assert (ours - ref).abs().max() < 0.1 * ref.abs().max(), (ours - ref).abs().max()
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_each_gemma_feature_changes_the_logits(tmp_path):
    """The features the test above checks are live in its configs: turning one off in the
    reference moves its logits (so a model that ignored it would fail)."""
    hf = save_checkpoint("Gemma2ForCausalLM", tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    ids = torch.arange(100) % TINY_GEMMA["vocab_size"]
    ours = runner_logits(runner, ids)
    assert ours.abs().max() <= 0.2  # the final soft cap
    for field, value in [("attn_logit_softcapping", None), ("sliding_window", 4096),
                         ("query_pre_attn_scalar", 16)]:  # fmt: skip
        changed = gemma_config("Gemma2ForCausalLM", **{field: value})
        other = transformers.Gemma2ForCausalLM(changed).eval()
        other.load_state_dict(hf.state_dict())
        with torch.inference_mode():
            ref = other(ids[None]).logits[0].float()
        assert (ours - ref).abs().max() > 1e-3, field


def test_gemma3_layers_rotate_by_their_own_theta(tmp_path):
    save_checkpoint("Gemma3ForCausalLM", tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    model = runner.model
    assert not torch.equal(model.rope_local.cos_sin_cache, model.rope_global.cos_sin_cache)
    assert runner.arch.qk_norm and runner.arch.sandwich_norms
    assert runner.arch.max_position_embeddings == 256  # the global layers' linear factor 2


def test_float16_gemma2_is_refused_before_loading(tmp_path):
    save_checkpoint("Gemma2ForCausalLM", tmp_path)
    with pytest.raises(ValueError, match="dtype float16 is not supported for gemma2"):
        load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128, dtype="float16"))


def test_unsupported_gemma_configs_are_refused():
    config = gemma_config("Gemma2ForCausalLM", hidden_activation="silu")
    with pytest.raises(ValueError, match="hidden_activation 'silu'"):
        GemmaForCausalLM.arch_from_hf(config)
    with torch.device("meta"):
        model = GemmaForCausalLM(GemmaForCausalLM.arch_from_hf(gemma_config("GemmaForCausalLM")))
    from vllm.model_executor.layers.quantization.gguf import model_gguf_layout

    with pytest.raises(ValueError, match="GemmaForCausalLM declares no gguf_layout"):
        model_gguf_layout(model)


def test_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """Gemma 3 through the engine: 16-token chunks over 12-token windows, batched decodes,
    a prefix hit; transformers' greedy tokens (the embedded model's tokenizer)."""
    hf = save_checkpoint("Gemma3ForCausalLM", tmp_path, vocab_size=49152,
                         max_position_embeddings=128)  # fmt: skip
    check_engine_greedy_matches(hf, tmp_path)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (a tiny vision tower beside the text
    model, tensors under ``language_model.model.``): text-only logits equal transformers',
    and the context length comes from its text config."""
    from vllm.model_executor.model_loader import model_max_len
    from vllm.model_executor.models.gemma import Gemma3ForConditionalGeneration

    text = {**TINY_GEMMA, **GEMMA["Gemma3ForCausalLM"]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=95,
        boi_token_index=93, eoi_token_index=94,
    )  # fmt: skip
    assert model_max_len(config) == 128
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert type(runner.model) is Gemma3ForConditionalGeneration
    assert runner.arch.sliding_windows == (12, None, 12)
    ids = torch.randint(0, 93, (60,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
