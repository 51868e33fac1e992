"""Idefics3 and SmolVLM (``models/idefics3.py``, its encoder ``models/idefics3_vision.py``)
against transformers' ``Idefics3ForConditionalGeneration`` and
``SmolVLMForConditionalGeneration`` on tiny random checkpoints: tile embeddings, logits of
a prompt holding an image's tiles, text logits, loading what save_pretrained writes, the
encoder's position ids, the image token layout, and the image processor the front end
reads (its tiles and the prompt text transformers builds for them)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.tiny_models import (
    TINY_LLAMA,
    cache_layout,
    check_image_logits,
    check_tile_embeddings,
    load_cpu_runner,
    perturbed,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.idefics3 import (
    Idefics3ForConditionalGeneration,
    image_token_layout,
    pixel_shuffle,
)
from vllm.model_executor.models.idefics3_vision import (
    Idefics3VisionArch,
    Idefics3VisionEmbeddings,
)
from vllm.model_executor.models.registry import ModelRegistry

IMAGE_TOKEN = 95  # the tiny vocabulary's last id
# 32-pixel tiles in 8-pixel patches: a 4 x 4 grid, shuffled by 2 into 4 tokens a tile.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, image_size=32, patch_size=8)  # fmt: skip
TOKENS_PER_TILE = 4
KINDS = {
    "smolvlm": (transformers.SmolVLMConfig, transformers.SmolVLMForConditionalGeneration,
                transformers.SmolVLMImageProcessorPil),
    "idefics3": (transformers.Idefics3Config, transformers.Idefics3ForConditionalGeneration,
                 transformers.Idefics3ImageProcessorPil),
}  # fmt: skip


def make_config(kind: str, text: dict | None = None, **overrides):
    """The tiny model's config: ``text`` overrides TINY_LLAMA's fields, ``overrides`` the
    top-level config's."""
    return KINDS[kind][0](
        text_config={**TINY_LLAMA, "model_type": "llama", **(text or {})},
        vision_config=VISION, **{"image_token_id": IMAGE_TOKEN, "scale_factor": 2, **overrides},
    )  # fmt: skip


def make_hf(kind: str, text: dict | None = None, **overrides):
    """A random tiny model (torch seed 0), its biases away from 0 and norms from 1 so that a
    misplaced one shows."""
    torch.manual_seed(0)
    hf = KINDS[kind][1](make_config(kind, text, **overrides)).eval()
    return perturbed(hf)


def image_processor(kind: str):
    """Split into 32-pixel tiles, an image's long side first resized to 64 pixels."""
    return KINDS[kind][2](max_image_size={"longest_edge": 32}, size={"longest_edge": 64})


def save(hf, kind: str, path) -> None:
    """The checkpoint as transformers writes it, with the image processor beside it."""
    hf.save_pretrained(path)
    image_processor(kind).save_pretrained(path)


def tiles(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(2))


def hf_tile_features(hf, px: torch.Tensor) -> torch.Tensor:
    """transformers' image features of tiles ``px`` (one sample holding them all)."""
    with torch.inference_mode():
        (features,) = hf.get_image_features(pixel_values=px[None]).pooler_output
    return features.view(len(px), TOKENS_PER_TILE, -1)


def load_ours(hf) -> Idefics3ForConditionalGeneration:
    model = Idefics3ForConditionalGeneration(
        Idefics3ForConditionalGeneration.arch_from_hf(hf.config)
    )
    model.load_weights(hf.state_dict())  # transformers 5's in-memory names
    return model


def image_prompt_logits(runner, ids: torch.Tensor, px: torch.Tensor) -> torch.Tensor:
    """``runner_logits`` with the tiles' embeddings written over their placeholders' rows,
    in order."""
    model = runner.model
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner))])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        embeds[ids == IMAGE_TOKEN] = model.embed_images(px).flatten(0, 1)
        hidden = model(ids, torch.arange(len(ids)), meta, runner.kv_caches, inputs_embeds=embeds)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", KINDS)
def test_embed_images_equal_transformers(kind):
    """Each tile alone: three tiles at once equal transformers' features of them, and the
    second tile alone its rows of the three."""
    hf = make_hf(kind)
    model = load_ours(hf)
    px = tiles(3)
    check_tile_embeddings(model, px, hf_tile_features(hf, px), TOKENS_PER_TILE)


@pytest.mark.parametrize("kind", KINDS)
def test_image_prompt_logits_equal_transformers(kind, tmp_path):
    """Text, two tiles' placeholders with a token between them (a tile marker), text: every
    position's logits equal transformers', and the image moves them."""
    hf = make_hf(kind)
    save(hf, kind, tmp_path)
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is Idefics3ForConditionalGeneration
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    token, n = image_token_layout(hf.config)
    g = torch.Generator().manual_seed(1)
    text = [torch.randint(0, 95, (k,), generator=g) for k in (5, 1, 7)]
    image = torch.full((n,), token)
    ids = torch.cat([text[0], image, text[1], image, text[2]])
    px = tiles(2)
    ours = image_prompt_logits(runner, ids, px)
    check_image_logits(runner, hf, ids, ours, pixel_values=px[None])


@pytest.mark.parametrize("kind,tie", [("smolvlm", False), ("idefics3", False), ("smolvlm", True)])
def test_saved_layout_loads_and_text_logits_equal_transformers(kind, tie, tmp_path):
    """save_pretrained writes the names transformers holds in memory (the Hub's); loaded from
    them, tile embeddings and text-only logits equal transformers'. The head is tied by the
    top-level ``tie_word_embeddings`` (text_config's says the opposite here)."""
    hf = make_hf(kind, text={"tie_word_embeddings": not tie}, tie_word_embeddings=tie)
    assert (hf.lm_head.weight is hf.get_input_embeddings().weight) == tie
    save(hf, kind, tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    assert "model.connector.modality_projection.proj.weight" in saved
    assert "model.text_model.embed_tokens.weight" in saved
    assert ("lm_head.weight" in saved) == (not tie)
    assert saved.keys() <= hf.state_dict().keys()
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    px = tiles(2)
    assert torch.allclose(runner.model.embed_images(px), hf_tile_features(hf, px), atol=1e-5)
    ids = torch.randint(0, 95, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    ours = runner_logits(runner, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("per_side", [4, 19, 25])
def test_position_embeddings_equal_transformers(per_side):
    """Full tiles' position ids by transformers' fractional buckets, which for 19 and 25
    patches a side give two patches one position (not an arange)."""
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionEmbeddings

    config = transformers.SmolVLMVisionConfig(hidden_size=8, num_attention_heads=2,
                                              image_size=2 * per_side,
                                              patch_size=2)  # fmt: skip
    torch.manual_seed(0)
    ref_module = SmolVLMVisionEmbeddings(config)
    ours = Idefics3VisionEmbeddings(Idefics3VisionArch.from_hf(config))
    ours.load_state_dict(ref_module.state_dict())
    px = torch.randn(2, 3, 2 * per_side, 2 * per_side)
    mask = torch.ones(2, per_side, per_side, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(ours(px), ref_module(px, mask))


def test_pixel_shuffle_order():
    """Patch (r, c) of a 4 x 4 grid, shuffled by 2: block (r // 2, c // 2), its place in the
    block's features ((r % 2) * 2 + c % 2)."""
    x = torch.arange(16.0).view(1, 16, 1)  # feature = the patch's row-major index
    out = pixel_shuffle(x, 2)
    assert out.tolist() == [[[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]]


def test_image_token_layout(tmp_path):
    """From the config and from config.json's dict; the Hub's shapes (SmolVLM-256M: 512-pixel
    tiles, 16-pixel patches, scale 4; Idefics3-8B: 364 and 14, scale 2)."""
    for kind in KINDS:
        hf = make_hf(kind)
        hf.config.save_pretrained(tmp_path / kind)
        config = json.loads((tmp_path / kind / "config.json").read_text())
        assert image_token_layout(hf.config) == image_token_layout(config)
        assert image_token_layout(config) == (IMAGE_TOKEN, TOKENS_PER_TILE)
    smolvlm = {"model_type": "smolvlm", "image_token_id": 49190, "scale_factor": 4,
               "vision_config": {"image_size": 512, "patch_size": 16}}  # fmt: skip
    assert image_token_layout(smolvlm) == (49190, 64)
    idefics3 = {"model_type": "idefics3", "image_token_id": 128257, "scale_factor": 2,
                "vision_config": {"image_size": 364, "patch_size": 14}}  # fmt: skip
    assert image_token_layout(idefics3) == (128257, 169)


@pytest.mark.parametrize("kind", KINDS)
def test_image_processor_tiles(kind, tmp_path, capsys):
    """What the front end gets from the saved processor: a 70 x 50 (w x h) image becomes
    2 x 2 full tiles, row-major, then the whole image as the last tile, none padded; a
    90 x 30 one 1 x 2 and the global tile; with no split (long side kept at the tile size)
    one tile, rows = cols = 0."""
    from PIL import Image

    save(make_hf(kind), kind, tmp_path)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    out = processor(images=[Image.new("RGB", (70, 50))], return_tensors="pt",
                    return_row_col_info=True)  # fmt: skip
    with capsys.disabled():
        shapes = {k: tuple(v.shape) if hasattr(v, "shape") else v for k, v in out.items()}
        print(f"\n{kind} 70x50 image: {shapes}")
    assert out["pixel_values"].shape == (1, 5, 3, 32, 32)
    assert out["pixel_attention_mask"].shape == (1, 5, 32, 32)
    assert bool(out["pixel_attention_mask"].all())
    assert (out["rows"], out["cols"]) == ([[2]], [[2]])
    # Quadrants of four colours: tile k is quadrant k (row-major), the last one all four.
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0)]
    image = Image.new("RGB", (64, 64))
    for k, colour in enumerate(colours):
        image.paste(colour, (32 * (k % 2), 32 * (k // 2), 32 * (k % 2 + 1), 32 * (k // 2 + 1)))
    px = processor(images=[image], return_tensors="pt")["pixel_values"][0]
    means = ((px[:, :, 8:24, 8:24].mean(dim=(2, 3)) + 1) * 127.5).round()  # undo the [-1, 1]
    assert means[:4].tolist() == [list(map(float, c)) for c in colours]
    assert torch.allclose(means[4], torch.tensor(colours, dtype=torch.float).mean(0), atol=2)
    out = processor(images=[Image.new("RGB", (90, 30))], return_tensors="pt",
                    return_row_col_info=True)  # fmt: skip
    assert out["pixel_values"].shape[1] == 3 and (out["rows"], out["cols"]) == ([[1]], [[2]])
    out = processor(images=[Image.new("RGB", (70, 50))], return_tensors="pt",
                    return_row_col_info=True, size={"longest_edge": 32})  # fmt: skip
    assert out["pixel_values"].shape == (1, 1, 3, 32, 32)
    assert (out["rows"], out["cols"]) == ([[0]], [[0]])


def test_transformers_prompt_string():
    """The text transformers' processors put in place of one image (what the front end's
    expansion mirrors): per tile, row-major, ``<fake_token_around_image><row_r_col_c>`` and
    its image tokens, a newline after each row, then a newline and the global tile wrapped
    in fake tokens; without a split, only the global one."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    kwargs = dict(image_seq_len=2, fake_token_around_image="<F>", image_token="<I>",
                  global_image_token="<G>")  # fmt: skip
    assert get_image_prompt_string(1, 2, **kwargs) == (
        "<F><row_1_col_1><I><I><F><row_1_col_2><I><I>\n\n<F><G><I><I><F>"
    )
    assert get_image_prompt_string(0, 0, **kwargs) == "<F><G><I><I><F>"


def test_refuses_what_it_cannot_serve():
    arch_from_hf = Idefics3ForConditionalGeneration.arch_from_hf
    with pytest.raises(ValueError, match="scale_factor 3"):
        arch_from_hf(make_config("smolvlm", scale_factor=3))  # 4 patches a side
    config = make_config("idefics3")
    config.text_config = transformers.GemmaConfig(**TINY_LLAMA, head_dim=16)
    with pytest.raises(ValueError, match="Llama-family"):
        arch_from_hf(config)
    bad = make_config("smolvlm")
    bad.vision_config.hidden_act = "relu6"
    with pytest.raises(ValueError, match="hidden_act"):
        arch_from_hf(bad)
    model = load_ours(make_hf("smolvlm"))
    with pytest.raises(ValueError, match="full tiles"):
        model.embed_images(torch.zeros(1, 3, 32, 24))  # a padded or cut tile
