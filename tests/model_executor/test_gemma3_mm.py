"""Gemma 3's images (``models/gemma.py``'s ``Gemma3ForConditionalGeneration``, its SigLIP
tower ``models/siglip_vision.py``) against transformers' on tiny random checkpoints: image
embeddings in fp32 and bf16 from each tensor layout, the logits of a prompt holding an
image (causal, as transformers computes them without ``token_type_ids``), text logits, the
refusals, ``takes_images`` and the image frame layout."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.tiny_models import (
    TINY_LLAMA,
    cache_layout,
    load_cpu_runner,
    perturbed,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.gemma import (
    Gemma3ForConditionalGeneration,
    ImageFrameLayout,
    image_frame_layout,
)
from vllm.model_executor.models.siglip_vision import SiglipVisionArch, SiglipVisionModel

BOI, EOI, IMAGE_TOKEN = 93, 94, 95  # the tiny vocabulary's last ids
# Two sliding layers (12-token windows, their own theta) around a global one.
TEXT = {
    **TINY_LLAMA, "head_dim": 16, "tie_word_embeddings": True, "num_hidden_layers": 3,
    "sliding_window": 12, "query_pre_attn_scalar": 24,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    },
}  # fmt: skip
# 32-pixel images in 4-pixel patches: 8 x 8 patches, pooled 2 x 2 into 16 image tokens.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=32, patch_size=4, vision_use_head=False)  # fmt: skip


def make_config(vision: dict | None = None, **overrides) -> transformers.Gemma3Config:
    """The tiny Gemma 3's config: ``vision`` overrides VISION's fields, ``overrides`` the
    Gemma3Config's."""
    return transformers.Gemma3Config(
        text_config=TEXT, vision_config={**VISION, **(vision or {})},
        **{"mm_tokens_per_image": 16, "image_token_index": IMAGE_TOKEN,
           "boi_token_index": BOI, "eoi_token_index": EOI, **overrides},
    )  # fmt: skip


def make_hf() -> transformers.Gemma3ForConditionalGeneration:
    """A random tiny Gemma 3 (torch seed 0): Gemma norms' weights (offsets from 1) and the
    tower's norms and biases drawn away from their initial values, the projection (zeros
    at init) drawn, so that a misplaced one shows."""
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(make_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "vision_tower" in name and "norm" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            elif "vision_tower" in name and name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):  # Gemma's: the offset from a scale of 1
                p.uniform_(-0.5, 0.5)
            elif name.endswith("mm_input_projection_weight"):
                p.normal_(0.0, 0.5)
    return hf


def pixels(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(2))


def hf_image_features(hf, px: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf.get_image_features(pixel_values=px).pooler_output


def save(hf, folder, layout: str = "saved") -> None:
    """The checkpoint in ``layout``: "saved" (what save_pretrained writes: the tower under
    ``vision_tower.``, the language model under ``language_model.model.``), "hub" (the
    tower under ``vision_tower.vision_model.``, as google/gemma-3-4b-it's), "memory" (the
    names transformers 5 holds in memory: ``model.vision_tower.``...), "no_tower" (the
    saved one without the tower's tensors)."""
    hf.save_pretrained(folder)
    file = folder / "model.safetensors"
    sd = load_file(file)
    assert "vision_tower.post_layernorm.weight" in sd
    assert "language_model.model.embed_tokens.weight" in sd
    if layout == "hub":
        sd = {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in sd.items()}
    elif layout == "memory":
        sd = {k: v.clone() for k, v in hf.state_dict().items()}  # lm_head: a tied copy
        assert "model.vision_tower.post_layernorm.weight" in sd
        assert "model.multi_modal_projector.mm_input_projection_weight" in sd
    elif layout == "no_tower":
        sd = {k: v for k, v in sd.items() if not k.startswith("vision_tower.")}
    save_file(sd, file, metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["saved", "hub", "memory"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embed_images_equal_transformers(dtype, layout, tmp_path):
    """Loaded from each layout by the runner, in each dtype: the image rows equal
    transformers' ``get_image_features(...).pooler_output``."""
    hf = make_hf()
    save(hf, tmp_path, layout)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128, dtype=dtype))
    model = runner.model
    assert type(model) is Gemma3ForConditionalGeneration
    assert "bidirectional_spans" in model.attention_features
    assert model.supports_images and model.bidirectional_image_attention
    px = pixels()
    ours = model.embed_images(px.double())  # cast to the model's dtype inside
    ref = hf_image_features(hf.to(getattr(torch, dtype)), px).float()
    assert ours.shape == (2, 16, TEXT["hidden_size"])
    assert ours.dtype == getattr(torch, dtype)
    assert ref.abs().mean() > 0.1
    if dtype == "float32":
        assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    else:  # bf16 rounding along the tower's 2 layers, the pool and the norm
        assert (ours.float() - ref).abs().max() <= 0.02 * ref.abs().max()


def test_image_prompt_and_text_logits_equal_transformers(tmp_path):
    """Text, an image's frame, text: the engine's way (``embed_input_ids``, the image's rows
    written over its placeholders', ``forward(inputs_embeds=)``) gives transformers'
    logits under its causal mask (no ``token_type_ids``); text alone gives its text
    logits, and the image moves them."""
    hf = make_hf()
    save(hf, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    model = runner.model
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(0, BOI, (5,), generator=g), torch.tensor([BOI]),
                     torch.full((16,), IMAGE_TOKEN), torch.tensor([EOI]),
                     torch.randint(0, BOI, (9,), generator=g)])  # fmt: skip
    px = pixels(1)
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner))])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        embeds[ids == IMAGE_TOKEN] = model.embed_images(px)[0]
        hidden = model(ids, torch.arange(len(ids)), meta, runner.kv_caches, inputs_embeds=embeds)
        ours = model.compute_logits(hidden)
        ref = hf(input_ids=ids[None], pixel_values=px).logits[0].float()
        text_ref = hf(input_ids=ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    text = runner_logits(runner, ids)
    assert torch.allclose(text, text_ref, atol=1e-4), (text - text_ref).abs().max()
    assert (text - ref).abs().max() > 1e-2


def test_siglip_tower_equals_transformers():
    """The tower alone against transformers' ``SiglipVisionModel`` (its head built, its
    tensors ignored), on an image size that is not a multiple of the patch size (30 / 4:
    7 x 7 patches, the last 2 pixels dropped as the "valid" convolution drops them)."""
    config = transformers.SiglipVisionConfig(**VISION | {"image_size": 30, "vision_use_head": True})
    torch.manual_seed(0)
    hf = perturbed(transformers.SiglipVisionModel(config))
    tower = SiglipVisionModel(SiglipVisionArch.from_hf(config))
    tower.load_weights(hf.state_dict())  # under vision_model.
    px = torch.randn(3, 3, 30, 30, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ours = tower(px)
        ref = hf(pixel_values=px).last_hidden_state
    assert ours.shape == (3, 49, 32)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    with pytest.raises(ValueError, match="pixel_values of shape"):
        tower(px[:, :, :28, :28])


def test_checkpoint_without_tower_is_refused(tmp_path):
    save(make_hf(), tmp_path, "no_tower")
    with pytest.raises(ValueError, match="no vision tower tensors.*vision_tower"):
        load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))


@pytest.mark.parametrize(
    "vision, overrides, message",
    [
        ({}, {"mm_tokens_per_image": 15}, "mm_tokens_per_image 15 is not a positive square"),
        ({}, {"mm_tokens_per_image": 9}, "mm_tokens_per_image 9: its side 3 does not divide"),
        ({"hidden_act": "relu6"}, {}, "vision_config.hidden_act 'relu6'"),
        ({"hidden_size": 30, "num_attention_heads": 4}, {}, "vision_config.hidden_size 30"),
    ],
)
def test_bad_configs_are_refused(vision, overrides, message):
    with pytest.raises(ValueError, match=message):
        Gemma3ForConditionalGeneration.arch_from_hf(make_config(vision, **overrides))


def test_arch_of_the_tiny_config():
    a = Gemma3ForConditionalGeneration.arch_from_hf(make_config())
    assert (a.mm_tokens_per_image, a.pool_kernel, a.vision.patches_per_side) == (16, 2, 8)
    assert a.sliding_windows == (12, None, 12) and a.hidden_size == 64
    a = Gemma3ForConditionalGeneration.arch_from_hf(make_config(mm_tokens_per_image=64))
    assert a.pool_kernel == 1


def test_takes_images_and_image_frame_layout(tmp_path):
    """From the config and config.json's dict; a dict without a vision_config takes none."""
    hf = make_hf()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    takes_images = Gemma3ForConditionalGeneration.takes_images
    assert takes_images(config) and takes_images(hf.config)
    assert not takes_images({k: v for k, v in config.items() if k != "vision_config"})
    expected = ImageFrameLayout(
        boi_token_id=BOI, image_token_id=IMAGE_TOKEN, eoi_token_id=EOI, tokens_per_image=16
    )
    assert image_frame_layout(hf.config) == image_frame_layout(config) == expected
