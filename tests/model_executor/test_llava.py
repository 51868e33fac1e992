"""LLaVA (``models/llava.py``, its CLIP tower ``models/clip.py``) against transformers'
``LlavaForConditionalGeneration`` on tiny random checkpoints: image embeddings for both
feature strategies and several feature layers, logits of a prompt holding an image, text
logits (and the engine's greedy tokens), loading from each tensor layout, the image token
layout and the image processor the front end reads."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.tiny_models import (
    TINY_LLAMA,
    cache_layout,
    check_engine_greedy_matches,
    check_image_logits,
    load_cpu_runner,
    perturbed,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.llava import LlavaForConditionalGeneration, image_token_layout
from vllm.model_executor.models.registry import ModelRegistry

IMAGE_TOKEN = 95  # the tiny vocabulary's last id
# A 28-pixel image in 14-pixel patches: 4 image tokens (5 with the CLS position).
VISION = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64,
              num_hidden_layers=3, num_attention_heads=4, image_size=28, patch_size=14)  # fmt: skip


def make_config(text: dict | None = None, **overrides) -> transformers.LlavaConfig:
    """The tiny LLaVA's config: ``text`` overrides TINY_LLAMA's fields, ``overrides`` the
    LlavaConfig's."""
    return transformers.LlavaConfig(
        text_config={**TINY_LLAMA, "model_type": "llama", **(text or {})},
        vision_config=VISION, **{"image_token_index": IMAGE_TOKEN, **overrides},
    )  # fmt: skip


def make_hf(text: dict | None = None, **overrides) -> transformers.LlavaForConditionalGeneration:
    """A random tiny LLaVA (torch seed 0), its biases away from 0 and norms from 1 so that a
    misplaced one shows."""
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(make_config(text, **overrides)).eval()
    return perturbed(hf)


def save(hf, path) -> None:
    """The checkpoint as transformers writes it, with the CLIP image processor beside it."""
    hf.save_pretrained(path)
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    ).save_pretrained(path)


def pixels(n: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(2))


def hf_image_features(hf, px: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return torch.stack(hf.get_image_features(pixel_values=px).pooler_output)


def image_prompt_logits(runner, ids: torch.Tensor, px: torch.Tensor) -> torch.Tensor:
    """``runner_logits`` with the image's embeddings written over its placeholders' rows."""
    model = runner.model
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner))])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        embeds[ids == IMAGE_TOKEN] = model.embed_images(px)[0]
        hidden = model(ids, torch.arange(len(ids)), meta, runner.kv_caches, inputs_embeds=embeds)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("strategy", ["default", "full"])
@pytest.mark.parametrize("layer", [-2, -1, [-3, -1]])
def test_embed_images_equal_transformers(strategy, layer):
    """Only the layers up to the deepest one read are built."""
    hf = make_hf(vision_feature_select_strategy=strategy, vision_feature_layer=layer)
    model = LlavaForConditionalGeneration(LlavaForConditionalGeneration.arch_from_hf(hf.config))
    model.load_weights(hf.state_dict())  # transformers 5's names
    assert model.arch.vision.num_layers == (2 if layer == -2 else 3)
    px = pixels(2)
    ours = model.embed_images(px.double())  # cast to the model's dtype inside
    ref = hf_image_features(hf, px)
    assert ours.shape == (2, 4 + (strategy == "full"), TINY_LLAMA["hidden_size"])
    assert ours.dtype == torch.float32
    assert ref.abs().mean() > 0.1
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_image_prompt_logits_equal_transformers(strategy, tmp_path):
    """Text, the image's placeholders, text: every position's logits equal transformers',
    and the image moves them (text-only logits of the same ids differ)."""
    from vllm.model_executor.model_loader import model_max_len

    hf = make_hf(vision_feature_select_strategy=strategy)
    save(hf, tmp_path)
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is LlavaForConditionalGeneration
    assert model_max_len(hf.config) == TINY_LLAMA["max_position_embeddings"]
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    token, n = image_token_layout(hf.config)
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(0, 95, (5,), generator=g), torch.full((n,), token),
                     torch.randint(0, 95, (7,), generator=g)])  # fmt: skip
    px = pixels()
    ours = image_prompt_logits(runner, ids, px)
    check_image_logits(runner, hf, ids, ours, pixel_values=px)


def rewrite(folder, layout: str, hf) -> None:
    """The folder's weights in ``layout``: "hub" (the tower under
    ``vision_tower.vision_model.``, as llava-hf's checkpoints), "transformers5" (the names
    transformers 5 holds in memory); "saved" leaves save_pretrained's."""
    file = folder / "model.safetensors"
    if layout == "hub":
        sd = load_file(file)
        sd = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in sd.items()}
        assert "vision_tower.vision_model.pre_layrnorm.weight" in sd
    elif layout == "transformers5":
        sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.vision_tower.pre_layrnorm.weight" in sd and "lm_head.weight" in sd
    else:
        assert "language_model.model.embed_tokens.weight" in load_file(file)
        return
    save_file(sd, file, metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["saved", "hub", "transformers5"])
def test_each_layout_loads(layout, tmp_path):
    """From each layout: image embeddings, and text logits through the plain forward,
    equal transformers'."""
    hf = make_hf()
    save(hf, tmp_path)
    rewrite(tmp_path, layout, hf)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    px = pixels(2)
    ours = runner.model.embed_images(px)
    assert torch.allclose(ours, hf_image_features(hf, px), atol=1e-5)
    ids = torch.randint(0, 95, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    ours = runner_logits(runner, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_engine_text_greedy_tokens_equal_transformers_generate(tmp_path):
    """The engine serves the checkpoint's language model, its context length and vocabulary
    read from ``text_config``: chunked prefill, batched decodes, a prefix hit."""
    hf = make_hf(text={"vocab_size": 49152, "max_position_embeddings": 256},
                 image_token_index=49151)  # fmt: skip
    hf.save_pretrained(tmp_path)
    check_engine_greedy_matches(hf, tmp_path)


def test_image_token_layout_and_image_processor(tmp_path):
    """From the config and from config.json's dict (llava-1.5's: 336-pixel images in
    14-pixel patches, the strategy left to its default); the saved processor yields pixels
    of the tower's size."""
    from PIL import Image

    hf = make_hf(vision_feature_select_strategy="full")
    save(hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert image_token_layout(hf.config) == image_token_layout(config) == (IMAGE_TOKEN, 5)
    assert image_token_layout(make_config()) == (IMAGE_TOKEN, 4)
    vision = {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14}
    hub = {"model_type": "llava", "image_token_index": 32000, "vision_config": vision}
    assert image_token_layout(hub) == (32000, 576)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    image = Image.new("RGB", (50, 40), (200, 30, 90))
    assert processor(images=[image], return_tensors="pt")["pixel_values"].shape == (1, 3, 28, 28)


def test_refuses_what_it_cannot_serve():
    arch_from_hf = LlavaForConditionalGeneration.arch_from_hf
    with pytest.raises(ValueError, match="vision_feature_layer"):
        arch_from_hf(make_config(vision_feature_layer=-5))  # the tower has 4 hidden states
    for text in (transformers.GemmaConfig(**TINY_LLAMA, head_dim=16),
                 transformers.GraniteConfig(**TINY_LLAMA, embedding_multiplier=3.0)):  # fmt: skip
        config = make_config()
        config.text_config = text
        with pytest.raises(ValueError, match="Llama-family"):
            arch_from_hf(config)
    with pytest.raises(ValueError, match="projector_hidden_act"):
        arch_from_hf(make_config(projector_hidden_act="relu6"))
