"""Qwen3-VL images (``models/qwen3_vl_vision.py`` and ``QwenVLForConditionalGeneration``
in ``models/llama.py``) against transformers on a tiny random checkpoint: the tower's rows
(the embedding and each deepstack feature), logits of a prompt holding two images (one
non-square) under the interleaved M-RoPE and the deepstack, text logits, the checkpoint as
save_pretrained writes it, the image layout and the M-RoPE table against transformers'
rotary."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import transformers
from safetensors import safe_open

from tests.model_executor.test_qwen2_vl import END, IMAGE, START, VIDEO, image_prompt
from tests.tiny_models import cache_layout, load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.models import llama
from vllm.model_executor.models.llama import QwenVLForConditionalGeneration
from vllm.model_executor.models.qwen2_vl_vision import QwenVLArch, qwen_vl_image_layout
from vllm.model_executor.models.qwen3_vl_vision import Qwen3VisionTransformer

HIDDEN = 64
TEXT = dict(vocab_size=200, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "mrope_section": [2, 3, 3], "mrope_interleaved": True})  # fmt: skip
# A 4 x 4 position table resampled to every grid; deepstack after blocks 2 and 0 (listed out
# of order: the features go in block order, each through its own merger), added after the
# language model's layers 0 and 1 of 3.
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=HIDDEN,
              patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16, deepstack_visual_indexes=[2, 0])  # fmt: skip
PATCH_DIM = 3 * 2 * 16 * 16
GRIDS = [(1, 8, 8), (1, 6, 10)]  # patches (t, h, w): 16 and 15 image tokens


def make_config(**vision):
    return transformers.Qwen3VLConfig(
        text_config=copy.deepcopy(TEXT), vision_config={**VISION, **vision},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END,
    )  # fmt: skip


def make_hf():
    """A random tiny model (torch seed 0), its biases away from 0 and norms from 1 so that a
    misplaced one shows, its attention far from uniform (so that positions matter) and its
    deepstack features as large as the embeddings (so that they matter)."""
    torch.manual_seed(0)
    hf = transformers.Qwen3VLForConditionalGeneration(make_config()).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif pname.endswith(("q_norm.weight", "k_norm.weight")):  # q, k are normed
                p.uniform_(2.0, 3.0)
            elif "norm" in pname:
                p.uniform_(0.5, 1.5)
            elif pname.endswith("attn.qkv.weight"):
                p.normal_(0.0, 0.5)
            elif "deepstack_merger_list" in pname and pname.endswith("linear_fc2.weight"):
                p.mul_(4)
    return hf


def save(hf, path) -> None:
    """The checkpoint as transformers writes it, with a small-image processor beside it
    (16-pixel patches, as Qwen3-VL's)."""
    hf.save_pretrained(path)
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, min_pixels=32 * 32, max_pixels=32 * 32 * 16
    )
    processor.save_pretrained(path)


def pixels(grids) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(t * h * w for t, h, w in grids)
    px = torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(2))
    return px, torch.tensor(grids)


def our_model(hf) -> QwenVLForConditionalGeneration:
    model = QwenVLForConditionalGeneration(QwenVLForConditionalGeneration.arch_from_hf(hf.config))
    model.load_weights(hf.state_dict())  # transformers 5's names
    return model


@pytest.fixture(scope="module")
def hf():
    return make_hf()


@pytest.fixture(scope="module")
def checkpoint(hf, tmp_path_factory):
    """(transformers' model, its saved folder)."""
    path = tmp_path_factory.mktemp("qwen3_vl")
    save(hf, path)
    return hf, path


def image_prompt_logits(runner, ids, px, grid, positions, same_embeds=True) -> torch.Tensor:
    """The prompt's logits as the engine computes them: the images' rows merged into the
    embeddings (``merge_image_rows``), run at ``positions``. ``same_embeds`` False: the
    forward reads a copy of the embeddings, which the deepstack features do not go with."""
    model = runner.model
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner))])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        rows = (ids == IMAGE).nonzero()[:, 0]
        model.merge_image_rows(embeds, rows, model.embed_images(px, grid))
        if not same_embeds:
            embeds = embeds.clone()
        hidden = model(ids, positions, meta, runner.kv_caches, inputs_embeds=embeds)
        assert model._deepstack is None  # dropped by the forward that read it
        return model.compute_logits(hidden)


@pytest.mark.parametrize("n_images", [1, 2])
def test_embed_images_equal_transformers(hf, n_images):
    """Each row: the merger's embedding, then the deepstack features in block order."""
    model = our_model(hf)
    assert isinstance(model.visual, Qwen3VisionTransformer)
    px, grid = pixels(GRIDS[:n_images])
    ours = model.embed_images(px.double(), grid)  # cast to the model's dtype inside
    with torch.inference_mode():
        out = hf.model.get_image_features(px, grid)
    refs = [torch.cat(out.pooler_output)] + [torch.cat(f) for f in out.deepstack_features]
    rows = sum(t * h * w for t, h, w in GRIDS[:n_images]) // 4
    assert ours.shape == (rows, HIDDEN * 3) and ours.dtype == torch.float32
    for part, ref in zip(ours.split(HIDDEN, dim=-1), refs, strict=True):
        assert ref.abs().mean() > 0.1
        assert torch.allclose(part, ref, atol=1e-5), (part - ref).abs().max()


def test_image_prompt_logits_equal_transformers(checkpoint):
    """Text and two images of different grids (one non-square): every position's logits
    equal transformers' under the 3-row positions of its ``get_rope_index``; without the
    deepstack features, or with M-RoPE's sections contiguous (Qwen2-VL's layout), they do
    not."""
    hf, path = checkpoint
    runner = load_cpu_runner(ModelConfig(model=str(path), max_model_len=128))
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
    no_deepstack = image_prompt_logits(runner, ids, px, grid, positions, same_embeds=False)
    assert (no_deepstack - ref).abs().max() > 0.1
    arch = model.arch
    model.arch = dataclasses.replace(arch, mrope_interleaved=False)
    try:
        contiguous = image_prompt_logits(runner, ids, px, grid, positions)
    finally:
        model.arch = arch
    assert (contiguous - ref).abs().max() > 0.1


def test_saved_checkpoint_loads(checkpoint):
    """save_pretrained's names (the Hub's: ``model.language_model.``, ``model.visual.``):
    image rows and text logits (plain 1-D positions) equal transformers'."""
    hf, path = checkpoint
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.visual.deepstack_merger_list.1.norm.weight" in names
    assert "model.language_model.layers.0.self_attn.q_norm.weight" in names
    runner = load_cpu_runner(ModelConfig(model=str(path), max_model_len=128))
    px, grid = pixels(GRIDS)
    with torch.inference_mode():
        out = hf.model.get_image_features(px, grid)
    refs = [out.pooler_output] + out.deepstack_features
    ours = runner.model.embed_images(px, grid)
    for part, ref in zip(ours.split(HIDDEN, dim=-1), refs, strict=True):
        assert torch.allclose(part, torch.cat(ref), atol=1e-5)
    ids = torch.randint(0, 190, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    ours = runner_logits(runner, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_mrope_table_equals_transformers_rotary():
    """Qwen3-VL's real sections (24, 20, 20) over 64 frequencies: each token's cos and sin
    equal transformers' interleaved M-RoPE at random (temporal, height, width) positions."""
    text = {**TEXT, "num_hidden_layers": 1, "head_dim": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                "mrope_section": [24, 20, 20]}}  # fmt: skip
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=VISION)
    model = QwenVLForConditionalGeneration(QwenVLForConditionalGeneration.arch_from_hf(config))
    model.init_buffers()
    assert model.arch.mrope_axes[:7] == (0, 1, 2, 0, 1, 2, 0)
    assert model.arch.mrope_axes[59:] == (2, 0, 0, 0, 0)
    positions = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(3))
    rotary = transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding(
        config.text_config
    )
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None])  # (1, 20, 128)
    table = model.mrope_table(positions)  # (20, 128): [cos | sin] of 64 frequencies
    assert torch.allclose(table[:, :64], cos[0, :, :64], atol=1e-6)
    assert torch.allclose(table[:, 64:], sin[0, :, :64], atol=1e-6)


def test_image_layout_and_image_processor(checkpoint):
    """From the config and config.json's dict; the saved processor's 16-pixel patches for a
    50 x 70 image (width x height: resized to 64 x 64, 4 x 4 patches, 4 image tokens)."""
    from PIL import Image

    hf, path = checkpoint
    config = json.loads((path / "config.json").read_text())
    assert qwen_vl_image_layout(hf.config) == qwen_vl_image_layout(config) == (IMAGE, 2)
    assert llama.qwen_vl_image_layout(config) == (IMAGE, 2)  # beside the model class
    assert qwen_vl_image_layout({"model_type": "qwen3_vl"}) == (151655, 2)
    assert QwenVLForConditionalGeneration.takes_images(config)
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    out = processor(images=[Image.new("RGB", (50, 70), (200, 30, 90))], return_tensors="pt")
    assert out["pixel_values"].shape == (16, PATCH_DIM)
    assert out["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_refuses_what_it_cannot_serve(hf):
    arch_from_hf = QwenVLForConditionalGeneration.arch_from_hf
    for field, value in (("deepstack_visual_indexes", [0, 3]), ("num_position_embeddings", 15)):
        with pytest.raises(ValueError, match=field):
            arch_from_hf(make_config(**{field: value}))
    model = our_model(hf)
    assert isinstance(model.arch, QwenVLArch) and model.arch.mrope_interleaved
    with pytest.raises(ValueError, match="pixel_values"):
        model.embed_images(torch.zeros(15, PATCH_DIM), torch.tensor([[1, 4, 4]]))
