"""InternVL3 / InternVL3.5 (``models/internvl.py``, its tower ``models/internvl_vision.py``)
against transformers' ``InternVLForConditionalGeneration`` on tiny random checkpoints (a
Qwen2 language model): tile embeddings for each norm type, with and without q/k norms, for
several feature layers; logits of a prompt holding an image's tiles; loading each tensor
layout with the head tied or not; the image context layout; what it refuses."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

# Its prompt logits with tiles written over the image tokens (95, the tiny vocabulary's last).
from tests.model_executor.test_idefics3 import IMAGE_TOKEN, image_prompt_logits
from tests.tiny_models import (
    TINY_LLAMA,
    check_image_logits,
    check_tile_embeddings,
    load_cpu_runner,
    perturbed,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.internvl import (
    InternVLForConditionalGeneration,
    image_context_layout,
)
from vllm.model_executor.models.registry import ModelRegistry

START, END = 93, 94  # <img> and </img>: the ids before IMAGE_TOKEN
# 28-pixel tiles in 7-pixel patches: a 4 x 4 grid, shuffled by 2 into 4 tokens a tile.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, image_size=28, patch_size=7)  # fmt: skip
TOKENS_PER_TILE = 4
# InternViT-6B's (InternVL3-78B): RMS norms, q/k norms; the tower's final layernorm read.
RMS_QK = dict(norm_type="rms_norm", use_qk_norm=True, attention_bias=True, use_mean_pooling=False)


def make_config(text: dict | None = None, vision: dict | None = None, **overrides):
    """The tiny model's config: ``text`` overrides TINY_LLAMA's fields (a Qwen2), ``vision``
    VISION's, ``overrides`` the InternVLConfig's."""
    return transformers.InternVLConfig(
        text_config={**TINY_LLAMA, "model_type": "qwen2", **(text or {})},
        vision_config={**VISION, **(vision or {})},
        **{"image_token_id": IMAGE_TOKEN, "image_seq_length": TOKENS_PER_TILE,
           "tie_word_embeddings": False, **overrides},
    )  # fmt: skip


def make_hf(text: dict | None = None, vision: dict | None = None, **overrides):
    """A random tiny InternVL (torch seed 0): biases away from 0, norms from 1, and the
    CLS token, position embeddings and layer scales (zeros and 0.1 at init) drawn, so that
    a misplaced one shows."""
    torch.manual_seed(0)
    hf = perturbed(
        transformers.InternVLForConditionalGeneration(make_config(text, vision, **overrides))
    )
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("cls_token", "position_embeddings")):
                p.normal_(0.0, 1.0)
            elif "lambda_" in name:
                p.uniform_(0.5, 1.5)
    return hf


def save(hf, path) -> None:
    """The checkpoint as transformers writes it, with the image processor beside it."""
    hf.save_pretrained(path)
    transformers.GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}).save_pretrained(path)


def tiles(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(2))


def hf_tile_features(hf, px: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf.get_image_features(pixel_values=px).pooler_output


def load_ours(hf) -> InternVLForConditionalGeneration:
    model = InternVLForConditionalGeneration(
        InternVLForConditionalGeneration.arch_from_hf(hf.config)
    )
    model.load_weights(hf.state_dict())  # transformers 5's in-memory names
    return model


@pytest.mark.parametrize(
    "vision,layer,built",
    [({}, -1, 2), (RMS_QK, -1, 2), (RMS_QK, -2, 1), ({"norm_type": "rms_norm"}, 1, 1),
     ({"use_absolute_position_embeddings": False}, -3, 0)],
)  # fmt: skip
def test_embed_images_equal_transformers(vision, layer, built):
    """Each tile alone, its CLS row dropped; -1 reads the tower's last hidden state (after
    its layernorm when use_mean_pooling is off), another index that hidden state unnormed;
    only the layers up to it are built."""
    hf = make_hf(vision=vision, vision_feature_layer=layer)
    model = load_ours(hf)
    assert model.arch.vision.num_layers == built
    px = tiles(3)
    check_tile_embeddings(model, px, hf_tile_features(hf, px), TOKENS_PER_TILE)


def test_image_prompt_logits_equal_transformers(tmp_path):
    """Text, an image of three tiles framed by <img> and </img>, text: every position's
    logits equal transformers', and the image moves them."""
    hf = make_hf(vision=RMS_QK)
    save(hf, tmp_path)
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is InternVLForConditionalGeneration
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    g = torch.Generator().manual_seed(1)
    image = torch.tensor([START, *[IMAGE_TOKEN] * 3 * TOKENS_PER_TILE, END])
    ids = torch.cat([torch.randint(0, 93, (5,), generator=g), image,
                     torch.randint(0, 93, (7,), generator=g)])  # fmt: skip
    px = tiles(3)
    ours = image_prompt_logits(runner, ids, px)
    check_image_logits(runner, hf, ids, ours, pixel_values=px)


def rewrite(folder, layout: str, hf) -> None:
    """The folder's weights in ``layout``: "memory" (the names transformers 5 holds in
    memory); "saved" leaves save_pretrained's (the Hub -hf checkpoints' names)."""
    file = folder / "model.safetensors"
    if layout == "memory":
        sd = {k: v.clone() for k, v in hf.state_dict().items()}  # lm_head: a tied copy
        assert "model.vision_tower.embeddings.cls_token" in sd and "lm_head.weight" in sd
        save_file(sd, file, metadata={"format": "pt"})
    else:
        saved = load_file(file)
        assert "language_model.model.embed_tokens.weight" in saved
        assert "vision_tower.encoder.layer.0.attention.q_proj.weight" in saved
        assert "multi_modal_projector.layer_norm.weight" in saved


@pytest.mark.parametrize(
    "layout,tie,text_tie",
    [("saved", False, False), ("memory", False, False), ("saved", True, True),
     ("saved", True, False), ("memory", True, True)],
)  # fmt: skip
def test_each_layout_loads_and_text_logits_equal_transformers(layout, tie, text_tie, tmp_path):
    """From each layout, the head tied or not: tile embeddings and text logits equal
    transformers'. (True, False): the top-level ``tie_word_embeddings`` (InternVL's
    default, which a config may leave unset) over an untied text model (Qwen2.5-7B's) and
    a checkpoint holding its own head: transformers keeps that head (both saved, and they
    differ), and so do we."""
    hf = make_hf(
        vision=RMS_QK, text={"tie_word_embeddings": text_tie}, tie_word_embeddings=tie and text_tie
    )
    save(hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": tie}))
    saved = load_file(tmp_path / "model.safetensors")
    assert ("language_model.lm_head.weight" in saved) == (not (tie and text_tie))
    hf = transformers.InternVLForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings == tie
    assert (hf.lm_head.weight is hf.get_input_embeddings().weight) == (tie and text_tie)
    rewrite(tmp_path, layout, hf)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert runner.model.arch.tie_word_embeddings == (tie and text_tie)
    px = tiles(2)
    assert torch.allclose(runner.model.embed_images(px), hf_tile_features(hf, px), atol=1e-5)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    ours = runner_logits(runner, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_bfloat16_embeddings_near_transformers(tmp_path):
    """Loaded by the runner in bfloat16: the rows, in bfloat16, near transformers' own in
    bfloat16 (rounding along the tower's 2 layers, the shuffle and the projector)."""
    hf = make_hf(vision=RMS_QK)
    save(hf, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128, dtype="bfloat16"))
    px = tiles(2)
    ours = runner.model.embed_images(px)
    ref = hf_tile_features(hf.to(torch.bfloat16), px).float()
    assert ours.dtype == torch.bfloat16
    assert (ours.float() - ref).abs().max() <= 0.03 * ref.abs().max()


def test_image_context_layout(tmp_path):
    """From the config and from config.json's dict; the Hub's shapes (InternVL3-1B-hf:
    448-pixel tiles in 14-pixel patches, downsample ratio 0.5: 256 tokens a tile)."""
    hf = make_hf()
    hf.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for c in (hf.config, config):
        layout = image_context_layout(c)
        assert (layout.image_token_id, layout.tokens_per_tile) == (IMAGE_TOKEN, TOKENS_PER_TILE)
        assert (layout.start_token, layout.end_token) == ("<img>", "</img>")
    hub = {"model_type": "internvl", "image_token_id": 151667, "downsample_ratio": 0.5,
           "vision_config": {"image_size": [448, 448], "patch_size": [14, 14]}}  # fmt: skip
    assert image_context_layout(hub).tokens_per_tile == 256


def test_refuses_what_it_cannot_serve():
    arch_from_hf = InternVLForConditionalGeneration.arch_from_hf
    gemma = transformers.GemmaConfig(**TINY_LLAMA, head_dim=16)
    granite = transformers.GraniteConfig(**TINY_LLAMA, embedding_multiplier=3.0)
    moe = transformers.Qwen3MoeConfig(**TINY_LLAMA, num_experts=4, num_experts_per_tok=2)
    for text in (gemma, granite, moe):
        config = make_config()
        config.text_config = text
        with pytest.raises(ValueError, match="text_config"):
            arch_from_hf(config)
    cases = [
        ({"vision_feature_layer": -4}, "vision_feature_layer"),  # the tower has 3 states
        ({"vision_feature_layer": [-1, -2]}, "vision_feature_layer"),
        ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
        ({"downsample_ratio": 0.3}, "downsample_ratio"),  # not 1 / an integer
        ({"downsample_ratio": 1 / 3}, "downsample_ratio"),  # 3 does not divide 4 patches
        ({"projector_hidden_act": "relu6"}, "projector_hidden_act"),
    ]
    for overrides, field in cases:
        with pytest.raises(ValueError, match=field):
            arch_from_hf(make_config(**overrides))
    with pytest.raises(ValueError, match="norm_type"):
        arch_from_hf(make_config(vision={"norm_type": "batch_norm"}))
    with pytest.raises(ValueError, match="image_size"):
        arch_from_hf(make_config(vision={"image_size": [28, 56]}))
