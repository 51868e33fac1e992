"""Architectures the Llama implementation runs through its flags (``models/llama.py``):
SmolLM3 (unrotated layers), Ministral (sliding windows), OLMo 2 (q/k norms over the whole
projection, output norms), OLMo 3 (that, with sliding layers rotated by their own theta)
and Seed-OSS (q/k/v biases, o_proj's under its own flag, a head_dim of its own). Tiny
checkpoints written by transformers give its logits past the windows, and OLMo 3's and
Seed-OSS's greedy tokens through the engine equal transformers' ``generate``."""

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
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

ROPES = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
         "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}  # fmt: skip
VARIANTS = {
    "SmolLM3": dict(no_rope_layer_interval=2, num_hidden_layers=3),
    "Ministral": dict(sliding_window=12, num_hidden_layers=3, head_dim=16),
    "Olmo2": dict(),
    "Olmo3": dict(sliding_window=12, num_hidden_layers=3, rope_parameters=ROPES,
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # EXAONE 4: output norms, per-head q/k norms, the global layer unrotated.
    "Exaone4": dict(sliding_window=12, num_hidden_layers=3, head_dim=16,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # Seed-OSS: q/k/v biases (attention_bias) and o_proj's (attention_out_bias), 4 heads of
    # 24 over a hidden size of 64.
    "SeedOss": dict(head_dim=24, attention_bias=True, attention_out_bias=True),
}  # fmt: skip


def variant_config(name: str, **overrides):
    fields = {**TINY_LLAMA, "pad_token_id": 0, **VARIANTS[name], **overrides}
    return getattr(transformers, f"{name}Config")(**fields)


def save(name: str, path, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(variant_config(name, **overrides))
    with torch.no_grad():  # norms away from 1 and biases from 0, so that a misplaced one shows
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif param_name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.eval().save_pretrained(path)
    return model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_logits_equal_transformers(name, tmp_path):
    hf = save(name, tmp_path)
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is LlamaForCausalLM
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a = runner.arch
    expected = {
        "SmolLM3": dict(rope_layers=(True, False, True), sliding_windows=(None,) * 3),
        "Ministral": dict(sliding_windows=(12, 12, 12)),
        "Olmo2": dict(qk_norm_full=True, post_norms=True),
        "Olmo3": dict(sliding_windows=(12, None, 12), post_norms=True),
        "Exaone4": dict(
            sliding_windows=(12, 12, None),
            post_norms=True,
            qk_norm=True,
            rope_layers=(True, True, False),
        ),
        "SeedOss": dict(head_dim=24, attention_bias=True, o_bias=True, qk_norm=False),
    }[name]
    for field, value in expected.items():
        assert getattr(a, field) == value, field
    assert (a.rope_local_parameters is not None) == (name == "Olmo3")
    n = 100
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (n,), generator=g)
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_each_flag_is_live(tmp_path):
    """Turning a flag off in our arch moves the logits away from transformers' (so a model
    that ignored it would fail the test above)."""
    import dataclasses

    from vllm.model_executor.models.llama import LlamaArch

    cases = {
        "SmolLM3": dict(rope_layers=()),
        "Olmo3": dict(rope_local_parameters=None),
        "Olmo2": dict(qk_norm=True, qk_norm_full=False, post_norms=False),
        "SeedOss": dict(o_bias=False),
    }
    for name, change in cases.items():
        hf = save(name, tmp_path / name)
        arch = dataclasses.replace(LlamaArch.from_hf(hf.config), **change)
        model = LlamaForCausalLM(arch)
        sd = hf.state_dict()
        if name == "Olmo2":  # per-head norms and input norms of the right shapes
            for key in list(sd):
                if key.endswith(("q_norm.weight", "k_norm.weight")):
                    sd[key] = sd[key][: arch.head_dim]
                elif key.endswith("post_feedforward_layernorm.weight"):
                    sd[key.replace("post_feedforward", "input")] = sd.pop(key)
        model.load_weights(sd)
        from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

        backend = TorchSDPABackend(4, 2, arch.head_dim, torch.float32, "cpu", 16)
        model.set_attention_backend(backend)
        caches = [torch.zeros(2, 9, 16, 2, arch.head_dim) for _ in model.layers]
        ids = torch.arange(60) % TINY_LLAMA["vocab_size"]
        meta = backend.build_metadata([(0, 60, list(range(1, 9)))])
        with torch.inference_mode():
            ours = model.compute_logits(model(ids, torch.arange(60), meta, caches))
            ref = hf(ids[None]).logits[0].float()
        assert (ours - ref).abs().max() > 1e-3, name


def test_olmo3_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """Chunked prefill over 12-token windows, batched decodes and a prefix hit."""
    hf = save("Olmo3", tmp_path, vocab_size=49152, max_position_embeddings=256)
    check_engine_greedy_matches(hf, tmp_path)


def test_seed_oss_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    hf = save("SeedOss", tmp_path, vocab_size=49152, max_position_embeddings=256)
    check_engine_greedy_matches(hf, tmp_path)


def test_mistral3_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Mistral-Small-3.x's layout: a vision tower beside the Mistral text model, its tensors
    under ``language_model.``; text-only logits equal transformers'."""
    from vllm.model_executor.model_loader import model_max_len
    from vllm.model_executor.models.mistral3 import Mistral3ForConditionalGeneration

    text = {**TINY_LLAMA, "head_dim": 16, "model_type": "mistral", "sliding_window": None}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=16,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = transformers.Mistral3Config(text_config=text, vision_config=vision,
                                         image_token_index=95)  # fmt: skip
    assert model_max_len(config) == TINY_LLAMA["max_position_embeddings"]
    torch.manual_seed(0)
    hf = transformers.Mistral3ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert type(runner.model) is Mistral3ForConditionalGeneration
    ids = torch.randint(0, 90, (60,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


QWEN_VL_VISION = {
    "Qwen2_5_VL": dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2,
                       out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, fullatt_block_indexes=[0], window_size=56),
    "Qwen3VL": dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2,
                    out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                    temporal_patch_size=2, num_position_embeddings=64,
                    deepstack_visual_indexes=[0]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(QWEN_VL_VISION))
def test_qwen_vl_checkpoint_serves_its_language_model(name, tmp_path):
    """Qwen2.5-VL's layout (the language model under ``model.``, the vision tower beside it,
    M-RoPE in the text config) and Qwen3-VL's (under ``model.language_model.``): text-only
    logits equal transformers', the multimodal rotation being the plain one for text."""
    from vllm.model_executor.models.llama import QwenVLForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if name == "Qwen3VL":
        rope["mrope_interleaved"] = True
    text = {**TINY_LLAMA, "head_dim": 16, "rope_parameters": rope}
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=QWEN_VL_VISION[name], image_token_id=95,
        video_token_id=94, vision_start_token_id=93,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert type(runner.model) is QwenVLForConditionalGeneration
    assert runner.arch.attention_bias == (name == "Qwen2_5_VL")
    assert runner.arch.qk_norm == (name == "Qwen3VL")
    ids = torch.randint(0, 90, (60,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
