"""Mistral 3 (``models/mistral3.py``, its Pixtral encoder ``models/pixtral_vision.py``)
against transformers' ``Mistral3ForConditionalGeneration`` and ``PixtralVisionModel`` on
tiny random checkpoints: the encoder on two images of different non-square sizes (each
attending to itself alone, rotated by its own rows and columns), the projector and its
patch merger, logits of a prompt holding two images, text logits, loading both tensor
layouts, a checkpoint without a tower, the image layout and the image processor's
output."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.tiny_models import (
    TINY_LLAMA,
    cache_layout,
    check_image_logits,
    load_cpu_runner,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.mistral3 import (
    Mistral3ForConditionalGeneration,
    image_rows_layout,
    merge_patches,
    takes_images,
)
from vllm.model_executor.models.pixtral_vision import PixtralVisionArch, PixtralVisionModel
from vllm.model_executor.models.registry import ModelRegistry

IMAGE, BREAK, END = 95, 94, 93  # the tiny vocabulary's last ids
TEXT = {**TINY_LLAMA, "head_dim": 16, "model_type": "mistral", "sliding_window": None}
# 4-pixel patches merged 2 x 2: one image token per 8 x 8 pixels.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              image_size=40, patch_size=4, hidden_act="silu")  # fmt: skip
SIZES = [(24, 40), (40, 16)]  # (H, W): 6 x 10 and 10 x 4 patches, 3 x 5 and 5 x 2 tokens


def make_config(text: dict | None = None, **overrides) -> transformers.Mistral3Config:
    return transformers.Mistral3Config(
        text_config={**TEXT, **(text or {})}, vision_config=VISION,
        **{"image_token_index": IMAGE, "multimodal_projector_bias": True,
           "tie_word_embeddings": False, **overrides},
    )  # fmt: skip


def make_hf(text: dict | None = None, **overrides):
    """A random tiny model (torch seed 0), its biases away from 0 and norms from 1 so that a
    misplaced one shows; the encoder's and projector's layers of unit gain (transformers'
    0.02 would leave the image rows nearly their biases), the encoder's q and k larger so
    that its attention is far from uniform (which patches an image sees, and where,
    matter)."""
    torch.manual_seed(0)
    hf = transformers.Mistral3ForConditionalGeneration(make_config(text, **overrides))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")) and "vision_tower" in name:
                p.normal_(0.0, 0.5)
            elif "vision_tower" in name or "multi_modal_projector" in name:
                p.normal_(0.0, p[0].numel() ** -0.5)  # fan_in ** -0.5 (the conv's too)
    return hf.eval()


def pixels(sizes=SIZES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randn(1, 3, h, w, generator=g) for h, w in sizes]


def padded(images: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' batch of ``images``: zero-padded to the largest sides, and their sizes."""
    height, width = (max(x.shape[d] for x in images) for d in (2, 3))
    batch = torch.zeros(len(images), 3, height, width)
    for i, x in enumerate(images):
        batch[i, :, : x.shape[2], : x.shape[3]] = x[0]
    return batch, torch.tensor([list(x.shape[2:]) for x in images])


def hf_image_features(hf, images) -> torch.Tensor:
    px, sizes = padded(images)
    with torch.inference_mode():
        return torch.cat(hf.model.get_image_features(px, sizes).pooler_output)


def load_ours(hf) -> Mistral3ForConditionalGeneration:
    model = Mistral3ForConditionalGeneration(
        Mistral3ForConditionalGeneration.arch_from_hf(hf.config)
    )
    model.load_weights(hf.state_dict())  # transformers 5's in-memory names
    return model


def save(hf, path) -> None:
    """The checkpoint as transformers writes it, with an image processor beside it (long
    side at most 40 pixels)."""
    hf.save_pretrained(path)
    transformers.PixtralImageProcessorPil(size={"longest_edge": 40}).save_pretrained(path)


def pixtral_replace_image_token():
    """transformers' ``PixtralProcessor.replace_image_token``, read from its source: the
    module imports torchvision, which the test machines may lack."""
    import ast
    from pathlib import Path

    from transformers.models import pixtral

    path = Path(pixtral.__file__).parent / "processing_pixtral.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if getattr(n, "name", None) == "PixtralProcessor")
    fn = next(n for n in cls.body if getattr(n, "name", None) == "replace_image_token")
    namespace: dict = {}
    exec(compile(ast.Module([fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["replace_image_token"]


def image_tokens(height: int, width: int, ids=(IMAGE, BREAK, END)) -> list[int]:
    """transformers' ``PixtralProcessor`` expansion of an image of ``height`` x ``width``
    pixels (8-pixel merged patches) as token ids ``ids`` ([IMG], [IMG_BREAK], [IMG_END])."""
    processor = SimpleNamespace(patch_size=4, spatial_merge_size=2, image_token="I ",
                                image_break_token="B ", image_end_token="E ")  # fmt: skip
    text = pixtral_replace_image_token()(processor, {"image_sizes": [(height, width)]}, 0)
    return [dict(zip("IBE", ids, strict=True))[t] for t in text.split()]


def image_prompt(sizes=SIZES) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 90, (5,), generator=g).tolist()
    for h, w in sizes:
        ids += image_tokens(h, w) + torch.randint(0, 90, (4,), generator=g).tolist()
    return torch.tensor(ids)


def image_prompt_logits(runner, ids: torch.Tensor, images) -> torch.Tensor:
    """The prompt's logits with the images' rows written over their [IMG] tokens' rows."""
    model = runner.model
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner))])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        embeds[ids == IMAGE] = torch.cat(model.embed_images(images))
        hidden = model(ids, torch.arange(len(ids)), meta, runner.kv_caches, inputs_embeds=embeds)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("layer", [-1, 1])
def test_vision_tower_equals_transformers(layer):
    """Two images of different sizes through transformers' padded batch and through ours,
    each at its own size: the hidden state read (the last, or the first block's) of every
    patch equals transformers'; the second image alone gives its own rows of them."""
    hf = make_hf(vision_feature_layer=layer)
    model = load_ours(hf)
    images = pixels()
    px, sizes = padded(images)
    with torch.inference_mode():
        ref = hf.model.vision_tower(px, image_sizes=sizes, output_hidden_states=True)
        ref = ref.hidden_states[layer][0]
        ours, grids = model.vision_tower([x[0].double() for x in images])  # cast inside
    assert grids == [(6, 10), (10, 4)] and len(model.vision_tower.transformer.layers) == layer % 3
    assert ours.shape == (100, 32) and ours.dtype == torch.float32
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    with torch.inference_mode():
        alone, _ = model.vision_tower([images[1][0]])
    assert torch.allclose(alone, ref[60:], atol=1e-5), (alone - ref[60:]).abs().max()


def test_embed_images_equal_transformers():
    """The encoder, projector and patch merger: each image's rows, row-major over its merged
    patches, equal transformers' features; a list of one tensor of two images too."""
    hf = make_hf()
    model = load_ours(hf)
    images = pixels()
    ours = model.embed_images(images)
    assert [x.shape for x in ours] == [(15, 64), (10, 64)]
    ref = hf_image_features(hf, images)
    assert ref.abs().mean() > 0.1
    assert torch.allclose(torch.cat(ours), ref, atol=1e-5), (torch.cat(ours) - ref).abs().max()
    same = pixels([(24, 40), (24, 40)])
    both = model.embed_images([torch.cat(same)])
    assert torch.allclose(torch.cat(both), hf_image_features(hf, same), atol=1e-5)


def test_projector_equals_transformers():
    """The projector (norm, patch merger, linear_1, act, linear_2) on the same features."""
    hf = make_hf()
    model = load_ours(hf)
    features = torch.randn(100, 32, generator=torch.Generator().manual_seed(3))
    grids = [(6, 10), (10, 4)]
    with torch.inference_mode():
        ours = model.multi_modal_projector(features, grids)
        ref = hf.model.multi_modal_projector(features, torch.tensor(SIZES))
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_patch_merger_order():
    """Patch (r, c) of a 4 x 4 grid (features: 10 * index, 10 * index + 1): block
    (r // 2, c // 2), feature-major: both features of the block's 4 patches in turn."""
    x = torch.arange(16.0)[:, None] * 10 + torch.tensor([0.0, 1.0])
    out = merge_patches(x, (4, 4), 2)
    assert out[0].tolist() == [0, 10, 40, 50, 1, 11, 41, 51]
    assert out[1].tolist() == [20, 30, 60, 70, 21, 31, 61, 71]
    assert out.shape == (4, 8)
    with pytest.raises(ValueError, match="multiples of 2"):
        merge_patches(torch.zeros(12, 2), (3, 4), 2)


def test_image_prompt_logits_equal_transformers(tmp_path):
    """Text, two images of different sizes as transformers' processor expands them (rows of
    [IMG], [IMG_BREAK] between rows, [IMG_END] last), text: every position's logits equal
    transformers', and the images move them."""
    hf = make_hf()
    save(hf, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    model = runner.model
    assert type(model) is Mistral3ForConditionalGeneration
    assert model.supports_images and model.image_layout == "rows" and model.images_at_own_size
    ids = image_prompt()
    assert int((ids == IMAGE).sum()) == 25 and int((ids == END).sum()) == 2
    images = pixels()
    px, sizes = padded(images)
    ours = image_prompt_logits(runner, ids, images)
    check_image_logits(runner, hf, ids, ours, pixel_values=px, image_sizes=sizes)


@pytest.mark.parametrize("layout", ["saved", "transformers5"])
def test_each_layout_loads(layout, tmp_path):
    """save_pretrained's names (the Hub's: ``language_model.model.``, ``vision_tower.``,
    ``language_model.lm_head``) and those transformers 5 holds (``model.language_model.``,
    ``model.vision_tower.``, ``lm_head``): image rows and text logits equal transformers'."""
    hf = make_hf()
    save(hf, tmp_path)
    file = tmp_path / "model.safetensors"
    if layout == "transformers5":
        sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.vision_tower.ln_pre.weight" in sd and "lm_head.weight" in sd
        save_file(sd, file, metadata={"format": "pt"})
    else:
        saved = load_file(file)
        assert "vision_tower.ln_pre.weight" in saved
        assert "language_model.lm_head.weight" in saved
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    images = pixels()
    ours = torch.cat(runner.model.embed_images(images))
    assert torch.allclose(ours, hf_image_features(hf, images), atol=1e-5)
    ids = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    ours = runner_logits(runner, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_tied_head_and_a_checkpoint_without_a_tower(tmp_path):
    """transformers' default ties the head (top-level ``tie_word_embeddings``), so
    save_pretrained leaves it out; with the tower's and projector's tensors left out too,
    the checkpoint is served as its language model: text logits equal transformers'."""
    hf = make_hf(tie_word_embeddings=True)
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    save(hf, tmp_path)
    file = tmp_path / "model.safetensors"
    sd = load_file(file)
    assert "language_model.lm_head.weight" not in sd
    text = {k: v for k, v in sd.items() if k.startswith("language_model.")}
    save_file(text, file, metadata={"format": "pt"})
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert runner.model.vision_tower is None and not runner.model.supports_images
    ids = torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert torch.allclose(runner_logits(runner, ids), ref, atol=1e-4)
    with pytest.raises(ValueError, match="text only"):
        runner.model.embed_images(pixels())


def test_image_layout_and_image_processor(tmp_path):
    """From the config and config.json's dict (Mistral-Small-3.1's: 14-pixel patches merged
    2 x 2); the saved processor, given the merged patch as PixtralProcessor gives it,
    resizes a 50 x 30 (w x h) image to 40 x 24 pixels, unpadded."""
    from PIL import Image

    hf = make_hf()
    save(hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    layout = image_rows_layout(config)
    assert layout == image_rows_layout(hf.config)
    assert (layout.image_token_id, layout.patch_pixels) == (IMAGE, 8)
    assert (layout.break_token, layout.end_token) == ("[IMG_BREAK]", "[IMG_END]")
    assert layout.break_token_id is None and layout.end_token_id is None
    hub = {"model_type": "mistral3", "image_token_index": 10, "spatial_merge_size": 2,
           "vision_config": {"model_type": "pixtral", "patch_size": 14}}  # fmt: skip
    assert image_rows_layout(hub).patch_pixels == 28
    assert takes_images(config) and takes_images(hf.config)
    assert not takes_images({k: v for k, v in config.items() if k != "vision_config"})
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is Mistral3ForConditionalGeneration
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    out = processor(images=[Image.new("RGB", (50, 30))], return_tensors="pt",
                    patch_size={"height": 8, "width": 8})  # fmt: skip
    assert out["pixel_values"].shape == (1, 3, 24, 40)
    assert out["image_sizes"].tolist() == [[24, 40]]


def test_transformers_prompt_string():
    """transformers' PixtralProcessor expansion of one image (what the "rows" layout
    mirrors): per row, its [IMG] tokens then [IMG_BREAK], the last one [IMG_END]."""
    assert image_tokens(16, 24) == [IMAGE] * 3 + [BREAK] + [IMAGE] * 3 + [END]
    assert image_tokens(8, 16) == [IMAGE, IMAGE, END]


def test_refuses_what_it_cannot_serve():
    arch_from_hf = Mistral3ForConditionalGeneration.arch_from_hf
    with pytest.raises(ValueError, match="vision_feature_layer"):
        arch_from_hf(make_config(vision_feature_layer=[-1, -2]))
    with pytest.raises(ValueError, match="vision_feature_layer"):
        arch_from_hf(make_config(vision_feature_layer=-4))  # the tower has 3 hidden states
    config = make_config()
    config.text_config = transformers.GemmaConfig(**TINY_LLAMA, head_dim=16)
    with pytest.raises(ValueError, match="Llama-family"):
        arch_from_hf(config)
    with pytest.raises(ValueError, match="projector_hidden_act"):
        arch_from_hf(make_config(projector_hidden_act="relu6"))
    with pytest.raises(ValueError, match="multiple of 4"):
        PixtralVisionArch.from_hf(
            transformers.PixtralVisionConfig(hidden_size=12, num_attention_heads=2), 1
        )
    tower = PixtralVisionModel(PixtralVisionArch.from_hf(make_config().vision_config, 1))
    with pytest.raises(ValueError, match="multiples of patch_size 4"):
        tower([torch.zeros(3, 8, 10)])
