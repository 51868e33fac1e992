"""Qwen2-VL and Qwen2.5-VL images (``models/qwen2_vl_vision.py`` and
``QwenVLForConditionalGeneration`` in ``models/llama.py``) against transformers on tiny
random checkpoints: image embeddings (Qwen2.5-VL's windows split the images, its full and
window blocks both run), logits of a prompt holding two images under M-RoPE's 3-row
positions, text logits, both tensor layouts, the image layout and the image processor's
output. Qwen3-VL: test_qwen3_vl.py."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.tiny_models import cache_layout, load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.models import llama
from vllm.model_executor.models.llama import QwenVLForConditionalGeneration
from vllm.model_executor.models.qwen2_vl_vision import (
    QwenVLArch,
    qwen_vl_image_layout,
    window_order,
)

IMAGE, VIDEO, START, END = 199, 198, 197, 196  # the tiny vocabulary's last ids
TEXT = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3]})  # fmt: skip
VISION = {
    "Qwen2VL": dict(depth=3, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                    patch_size=14, temporal_patch_size=2, spatial_merge_size=2),
    # 56-pixel windows: 2 x 2 merge blocks (4 x 4 patches); blocks 1 and 3 attend whole.
    "Qwen2_5_VL": dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=4,
                       out_hidden_size=64, patch_size=14, temporal_patch_size=2,
                       spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1, 3]),
}  # fmt: skip
PATCH_DIM = 3 * 2 * 14 * 14
# Patch grids (t, h, w): 8 x 8 patches make 2 x 2 windows; 6 x 10 uneven ones (3 x 5 blocks).
GRIDS = [(1, 8, 8), (1, 6, 10)]


def make_hf(name: str):
    """A random tiny model (torch seed 0), its biases away from 0 and norms from 1 so that a
    misplaced one shows, its attention far from uniform (so that which patches the tower
    sees, and the positions of the text's, matter)."""
    config = getattr(transformers, f"{name}Config")(
        text_config=copy.deepcopy(TEXT), vision_config=VISION[name], image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in pname or "ln_q" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith(("attn.qkv.weight", "q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.5 if "visual" in pname else 0.15)
    return hf


def save(hf, path) -> None:
    """The checkpoint as transformers writes it, with a small-image processor beside it."""
    hf.save_pretrained(path)
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    processor.save_pretrained(path)


def pixels(grids) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(t * h * w for t, h, w in grids)
    px = torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(2))
    return px, torch.tensor(grids)


def hf_image_features(hf, px, grid) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat(hf.model.get_image_features(px, grid).pooler_output)


def our_model(hf) -> QwenVLForConditionalGeneration:
    model = QwenVLForConditionalGeneration(QwenVLForConditionalGeneration.arch_from_hf(hf.config))
    model.load_weights(hf.state_dict())  # transformers 5's names
    return model


def image_prompt(grids) -> torch.Tensor:
    """Text, then each image between its start and end markers as transformers' processor
    expands it (t * h * w / 4 image tokens), then text."""
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(0, 190, (5,), generator=g)]
    for t, h, w in grids:
        parts += [torch.tensor([START]), torch.full((t * h * w // 4,), IMAGE),
                  torch.tensor([END]), torch.randint(0, 190, (4,), generator=g)]  # fmt: skip
    return torch.cat(parts)


def image_prompt_logits(runner, ids, px, grid, positions) -> torch.Tensor:
    """The prompt's logits with the images' rows written over their tokens' embeddings,
    run at ``positions``."""
    model = runner.model
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner))])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        embeds[ids == IMAGE] = model.embed_images(px, grid)
        hidden = model(ids, positions, meta, runner.kv_caches, inputs_embeds=embeds)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(VISION))
@pytest.mark.parametrize("n_images", [1, 2])
def test_embed_images_equal_transformers(name, n_images):
    hf = make_hf(name)
    model = our_model(hf)
    px, grid = pixels(GRIDS[:n_images])
    ours = model.embed_images(px.double(), grid)  # cast to the model's dtype inside
    ref = hf_image_features(hf, px, grid)
    assert ours.shape == (sum(t * h * w for t, h, w in GRIDS[:n_images]) // 4, 64)
    assert ours.dtype == torch.float32
    assert ref.abs().mean() > 0.1
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_qwen2_5_windows_split_the_images():
    """The 8 x 8 grid in 4 windows of 4 blocks, the 6 x 10 one in 6 uneven ones; the order
    is a permutation of every merged row."""
    order, bounds = window_order(GRIDS, 2, 2)
    assert sorted(order.tolist()) == list(range(16 + 15))
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert sizes == [16] * 4 + [16, 16, 8, 8, 8, 4]  # in patches
    assert order[:8].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def test_qwen2_5_window_blocks_matter():
    """With every block attending whole, the features differ: the window blocks run."""
    hf = make_hf("Qwen2_5_VL")
    px, grid = pixels(GRIDS)
    model = our_model(hf)
    assert isinstance(model.arch, QwenVLArch) and model.arch.vision.fullatt_block_indexes == (1, 3)
    windowed = model.embed_images(px, grid)
    model.visual.arch = dataclasses.replace(model.arch.vision, fullatt_block_indexes=(0, 1, 2, 3))
    assert (model.embed_images(px, grid) - windowed).abs().max() > 1e-3


@pytest.mark.parametrize("name", list(VISION))
def test_image_prompt_logits_equal_transformers(name, tmp_path):
    """Text and two images of different sizes: every position's logits equal transformers'
    under the 3-row positions of its ``get_rope_index``; with 1-D positions they do not
    (M-RoPE moves them), and 3 equal rows are exactly the 1-D path."""
    hf = make_hf(name)
    save(hf, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    model = runner.model
    assert type(model) is QwenVLForConditionalGeneration
    assert model.supports_images and model.uses_mrope and model.image_layout == "grid"
    ids = image_prompt(GRIDS)
    px, grid = pixels(GRIDS)
    types = (ids == IMAGE).int()[None]
    positions, _ = hf.model.get_rope_index(ids[None], types, image_grid_thw=grid)
    positions = positions[:, 0]  # (3, num_tokens)
    assert (positions[0] != positions[1]).any() and positions.max() < len(ids) - 1
    with torch.inference_mode():
        ref = hf(input_ids=ids[None], pixel_values=px, image_grid_thw=grid,
                 mm_token_type_ids=types).logits[0].float()  # fmt: skip
    ours = image_prompt_logits(runner, ids, px, grid, positions)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    flat = image_prompt_logits(runner, ids, px, grid, torch.arange(len(ids)))
    assert (flat - ref).abs().max() > 1e-3
    same = image_prompt_logits(runner, ids, px, grid, torch.arange(len(ids)).expand(3, -1))
    assert torch.equal(same, flat)


@pytest.mark.parametrize("name", list(VISION))
@pytest.mark.parametrize("layout", ["saved", "transformers5"])
def test_each_layout_loads(name, layout, tmp_path):
    """save_pretrained's names (the Hub's: ``model.layers.``, ``visual.``) and those
    transformers 5 holds (``model.language_model.``, ``model.visual.``): image embeddings
    and text logits through the plain forward equal transformers'."""
    hf = make_hf(name)
    save(hf, tmp_path)
    if layout == "transformers5":
        sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
        assert "model.visual.merger.ln_q.weight" in sd
        save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    px, grid = pixels(GRIDS)
    ours = runner.model.embed_images(px, grid)
    assert torch.allclose(ours, hf_image_features(hf, px, grid), atol=1e-5)
    ids = torch.randint(0, 190, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    ours = runner_logits(runner, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_image_layout_and_image_processor(tmp_path):
    """From the config and config.json's dict; the saved processor's patches for a 50 x 70
    image (width x height: resized to 56 x 56, 4 x 4 patches, 4 image tokens)."""
    from PIL import Image

    hf = make_hf("Qwen2VL")
    save(hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert qwen_vl_image_layout(hf.config) == qwen_vl_image_layout(config) == (IMAGE, 2)
    assert llama.qwen_vl_image_layout(config) == (IMAGE, 2)  # beside the model class
    assert qwen_vl_image_layout({"model_type": "qwen2_5_vl"}) == (151655, 2)
    assert QwenVLForConditionalGeneration.takes_images(config)
    assert not QwenVLForConditionalGeneration.takes_images({"model_type": "llava"})
    with pytest.raises(ValueError, match="llava"):
        qwen_vl_image_layout({"model_type": "llava"})
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    out = processor(images=[Image.new("RGB", (50, 70), (200, 30, 90))], return_tensors="pt")
    assert out["pixel_values"].shape == (16, PATCH_DIM)
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_refuses_what_it_cannot_serve():
    arch_from_hf = QwenVLForConditionalGeneration.arch_from_hf
    hf = make_hf("Qwen2VL")
    config = hf.config
    config.text_config.rope_parameters["mrope_section"] = [2, 3, 4]  # 9 of 8 frequencies
    with pytest.raises(ValueError, match="mrope_section"):
        arch_from_hf(config)
    model = our_model(make_hf("Qwen2VL"))
    with pytest.raises(ValueError, match="spatial_merge_size"):
        model.embed_images(torch.zeros(15, PATCH_DIM), torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match="pixel_values"):
        model.embed_images(torch.zeros(15, PATCH_DIM), torch.tensor([[1, 4, 4]]))
