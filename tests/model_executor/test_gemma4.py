"""Gemma 4 (``models/gemma4.py``): tiny checkpoints written by transformers give
transformers' logits past their sliding windows, with global layers of another head size
(and, with ``attention_k_eq_v``, fewer KV heads and no v projection), per-layer inputs,
KV-shared layers (with double-wide MLPs) and the MoE block beside the MLP; the engine's
greedy tokens (chunked prefill, batched decodes, a prefix hit) equal transformers'
``generate``; a multimodal checkpoint serves its language model, its vision tower beside
it (images: test_gemma4_mm.py), and refuses audio and video."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tests.tiny_models import (
    TINY_LLAMA,
    check_engine_greedy_matches,
    load_cpu_runner,
    perturbed,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from vllm.model_executor.models.registry import ModelRegistry

LAYERS = ["sliding_attention", "full_attention"] * 3
TINY_GEMMA4 = {**TINY_LLAMA, "head_dim": 16, "global_head_dim": 32, "num_hidden_layers": 6,
               "layer_types": LAYERS, "sliding_window": 12, "tie_word_embeddings": True,
               "final_logit_softcapping": 3.0, "hidden_size_per_layer_input": 0,
               "rope_parameters": {
                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                   "full_attention": {"rope_type": "proportional", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.25}}}  # fmt: skip
FEATURES = {
    # gemma-4-E2B's kind: per-layer inputs, the last two layers on earlier layers' K/V,
    # with twice as wide MLPs.
    "per_layer_inputs_kv_sharing": dict(hidden_size_per_layer_input=8,
                                        vocab_size_per_layer_input=96, num_kv_shared_layers=2,
                                        use_double_wide_mlp=True),
    # gemma-4-26B-A4B's kind: experts beside the MLP; global layers with one KV head, values
    # from the keys' projection.
    "moe_k_eq_v": dict(enable_moe_block=True, num_experts=4, top_k_experts=2,
                       moe_intermediate_size=24, attention_k_eq_v=True,
                       num_global_key_value_heads=1, use_bidirectional_attention="vision"),
}  # fmt: skip


def gemma4_config(*features: str, **overrides) -> transformers.Gemma4TextConfig:
    fields = dict(TINY_GEMMA4)
    for f in features:
        fields.update(FEATURES[f])
    return transformers.Gemma4TextConfig(**{**fields, **overrides})


def randomized(hf: torch.nn.Module) -> torch.nn.Module:
    """``perturbed`` (norms away from 1), and the router's scales and the layer scalars
    too (transformers starts them at 1)."""
    torch.manual_seed(0)
    perturbed(hf)
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith(("router.scale", "per_expert_scale", "layer_scalar")):
                t.uniform_(0.5, 1.5)
    return hf


def save_checkpoint(path, *features: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(gemma4_config(*features, **overrides))
    randomized(hf).save_pretrained(path)
    return hf


def test_gemma4_architectures_resolve_to_the_gemma4_implementation():
    config = gemma4_config()
    assert ModelRegistry.resolve_model_cls(config)[0] is Gemma4ForCausalLM
    mm = transformers.Gemma4Config(text_config=config.to_dict(), vision_config=None)
    assert ModelRegistry.resolve_model_cls(mm)[0] is Gemma4ForConditionalGeneration


@pytest.mark.parametrize("features", list(FEATURES))
def test_gemma4_checkpoint_logits_equal_transformers(features, tmp_path):
    hf = save_checkpoint(tmp_path, features)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a = runner.arch
    assert (a.head_dim, a.layer_head_dims) == (32, (16, 32) * 3)
    if features == "per_layer_inputs_kv_sharing":
        # Layers 4 and 5 attend over layers 2's and 3's K/V: four cache layers.
        assert a.kv_source == (0, 1, 2, 3, 2, 3) and a.num_layers == 4
        assert a.sliding_windows == (12, None, 12, None)
        assert runner.model.layers[5].down_proj.in_features == 2 * a.intermediate_size
    else:
        assert a.layer_kv_heads == (2, 1) * 3 and a.num_kv_heads == 2 and a.num_layers == 6
    ids = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert len(runner.kv_caches) == a.num_layers
    assert ref.abs().max() <= 3.0  # the final soft cap
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_gemma4_bfloat16_logits_are_as_close_as_transformers(tmp_path):
    """In bf16 the tiny model's logits (at most ~0.7) move by a third of their size in
    transformers too: ours are no farther from the fp32 logits than transformers' bf16
    ones."""
    hf = save_checkpoint(tmp_path, *FEATURES)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128, dtype="bfloat16"))
    ids = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(2))
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        exact = hf(ids[None]).logits[0].float()
        ref = hf.to(torch.bfloat16)(ids[None]).logits[0].float()
    assert (ours - exact).abs().max() <= 1.5 * (ref - exact).abs().max()
    assert (ours - exact).abs().mean() <= 1.5 * (ref - exact).abs().mean()


def test_unsupported_gemma4_configs_are_refused():
    with pytest.raises(ValueError, match="use_bidirectional_attention 'all'"):
        Gemma4ForCausalLM.arch_from_hf(gemma4_config(use_bidirectional_attention="all"))
    for act in ("silu", "gelu"):  # transformers' "gelu" is the exact one
        with pytest.raises(ValueError, match=f"hidden_activation '{act}'"):
            Gemma4ForCausalLM.arch_from_hf(gemma4_config(hidden_activation=act))


def test_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """Every feature at once through the engine: 16-token chunks over 12-token windows,
    KV-shared layers reading their sources' cache, batched decodes, a prefix hit."""
    hf = save_checkpoint(tmp_path, *FEATURES, vocab_size=49152,
                         vocab_size_per_layer_input=49152)  # fmt: skip
    check_engine_greedy_matches(hf, tmp_path)


def test_multimodal_checkpoint_serves_text_and_refuses_audio_and_video(tmp_path):
    """A Gemma4ForConditionalGeneration checkpoint (vision and audio towers beside the
    text model, under ``model.language_model.``): text-only logits equal transformers'
    (an image token id with no image embedded as padding, as transformers does), the
    vision tower is built, the audio tower's tensors are never read, and the engine
    refuses audio and video (images: test_gemma4_mm.py)."""
    from PIL import Image

    from tests.utils import copy_benchmark_tokenizer
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    text = gemma4_config("per_layer_inputs_kv_sharing").to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                  position_embedding_size=64)  # fmt: skip
    audio = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 subsampling_conv_channels=[8, 4], output_proj_dims=32)  # fmt: skip
    config = transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=audio, image_token_id=95,
        video_token_id=94, audio_token_id=93, boi_token_id=92, eoi_token_id=91,
        boa_token_id=90, eoa_token_index=89,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = randomized(transformers.Gemma4ForConditionalGeneration(config))
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    model = runner.model
    assert type(model) is Gemma4ForConditionalGeneration
    names = [n for n, _ in model.named_parameters()]
    assert not any("audio" in n for n in names) and any("vision_tower" in n for n in names)
    ids = torch.randint(0, 89, (60,), generator=torch.Generator().manual_seed(1))
    ids[7] = 95
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()

    copy_benchmark_tokenizer(tmp_path)
    llm = LLM(model=str(tmp_path), max_model_len=64, kv_cache_memory="16MiB")
    try:
        for modality, data in (("audio", np.zeros(1600)), ("video", [Image.new("RGB", (32, 32))])):
            with pytest.raises(VLLMValidationError, match=f"modality '{modality}' is not"):
                llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {modality: data}})
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": ids[:20].tolist()}, params)[0]
    finally:
        llm.shutdown()
    with torch.inference_mode():
        expected = hf.generate(ids[None, :20], max_new_tokens=6, do_sample=False)[0, 20:]
    assert list(out.outputs[0].token_ids) == expected.tolist()
