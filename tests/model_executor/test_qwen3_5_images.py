"""Qwen3.5 images (``Qwen3_5ForConditionalGeneration`` and its MoE twin in
``models/qwen3_next.py``: Qwen3-VL's tower without DeepStack, interleaved M-RoPE over the
partial rotation, Gated DeltaNet layers reading image rows as any rows) against
transformers on a tiny random checkpoint (4 layers, 3 linear and 1 full attention): the
tower's rows, the logits of a prompt holding two images (one non-square) at
``get_rope_index``'s positions, text logits, the M-RoPE table at the released sizes, and
the engine's greedy tokens (whole, in chunks of 5, and from a prefix hit restored from a
checkpoint of the recurrent states that ends inside the second image)."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

from tests.model_executor.test_qwen2_vl import END, IMAGE, START, VIDEO, image_prompt
from tests.model_executor.test_qwen3_vl import GRIDS, pixels, save
from tests.multimodal.utils import check_engine_images, hf_greedy
from tests.tiny_models import cache_layout, load_cpu_runner, perturbed, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.models import qwen3_next
from vllm.model_executor.models.qwen3_next import Qwen3_5ForConditionalGeneration, Qwen3_5VLArch
from vllm.model_executor.models.qwen3_vl_vision import Qwen3VisionTransformer

HIDDEN = 48
LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
# 16 of each head's 64 dims rotate (Qwen3.5's factor 0.25): 8 frequencies, interleaved
# over sections (2, 3, 3) as t h w t h w t h; a low theta so that positions show.
TEXT = dict(vocab_size=200, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=4,
            layer_types=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, linear_conv_kernel_dim=4, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0,
                             "partial_rotary_factor": 0.25, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})  # fmt: skip
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=HIDDEN,
              patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16)  # fmt: skip
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
              vision_end_token_id=END)  # fmt: skip
# Two images (4 and 8 tokens at the saved processor's sizes): 23 prompt tokens, the second
# image at 13..20, so that the prompt's last block boundary (20, blocks of 4), where its
# recurrent states are checkpointed, and a prefix hit of it, end inside that image.
PROMPT = [5, 6, 7, START, IMAGE, END, 8, 9, 10, START, IMAGE, END, 11]


def make_hf(moe: bool = False):
    """A random tiny model (torch seed 0), perturbed as test_qwen3_next's (norms, biases,
    decays slow enough to carry a state across chunks), the merger's output scaled up so
    that the images move the logits."""
    if moe:
        text = dict(TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=20)  # fmt: skip
        config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **TOKENS)
    else:
        config = transformers.Qwen3_5Config(text_config=copy.deepcopy(TEXT),
                                            vision_config=VISION, **TOKENS)  # fmt: skip
    torch.manual_seed(0)
    cls = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    hf = perturbed(getattr(transformers, cls)(config))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -1.5)
            elif name.endswith("attn.qkv.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("merger.linear_fc2.weight"):
                p.mul_(10)
        hf.lm_head.weight.normal_(0.0, 0.3)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model, its saved folder with Qwen3-VL's image processor beside it)."""
    hf = make_hf()
    path = tmp_path_factory.mktemp("qwen3_5_images")
    save(hf, path)
    return hf, path


@pytest.fixture(scope="module")
def runner(checkpoint):
    return load_cpu_runner(ModelConfig(model=str(checkpoint[1]), max_model_len=128))


def image_prompt_logits(runner, ids, px, grid, positions) -> torch.Tensor:
    """The prompt's logits as the engine computes them: the images' rows written over
    their tokens' embeddings, run at ``positions``."""
    model = runner.model
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner))])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        embeds[ids == IMAGE] = model.embed_images(px, grid)
        hidden = model(ids, positions, meta, runner.kv_caches, inputs_embeds=embeds)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("n_images", [1, 2])
def test_embed_images_equal_transformers(checkpoint, runner, n_images):
    """The rows of Qwen3-VL's tower without deepstack features: the language model's width."""
    hf, _ = checkpoint
    model = runner.model
    assert isinstance(model.visual, Qwen3VisionTransformer)
    assert model.arch.vision.deepstack_visual_indexes == () and not hasattr(
        hf.model.visual, "deepstack_merger_list"
    )  # fmt: skip
    px, grid = pixels(GRIDS[:n_images])
    ours = model.embed_images(px.double(), grid)  # cast to the model's dtype inside
    with torch.inference_mode():
        ref = torch.cat(hf.model.get_image_features(px, grid).pooler_output)
    rows = sum(t * h * w for t, h, w in GRIDS[:n_images]) // 4
    assert ours.shape == (rows, HIDDEN) and ours.dtype == torch.float32
    assert ref.abs().mean() > 0.1
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()


def test_image_prompt_logits_equal_transformers(checkpoint, runner, monkeypatch):
    """Text and two images of different grids (one non-square): every position's logits
    equal transformers' at its ``get_rope_index`` positions; with plain positions, or with
    M-RoPE's sections contiguous (Qwen2-VL's layout), they do not. A text prompt (1-D
    positions) equals transformers' too."""
    hf, _ = checkpoint
    model = runner.model
    assert type(model) is Qwen3_5ForConditionalGeneration
    assert model.supports_images and model.uses_mrope and model.image_layout == "grid"
    ids = image_prompt(GRIDS)
    px, grid = pixels(GRIDS)
    types = (ids == IMAGE).int()[None]
    positions = hf.model.get_rope_index(ids[None], types, image_grid_thw=grid)[0][:, 0]
    assert (positions[0] != positions[1]).any() and positions.max() < len(ids) - 1
    with torch.inference_mode():
        ref = hf(input_ids=ids[None], pixel_values=px, image_grid_thw=grid,
                 mm_token_type_ids=types).logits[0].float()  # fmt: skip
    assert ref.std() > 0.3
    ours = image_prompt_logits(runner, ids, px, grid, positions)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    plain = image_prompt_logits(runner, ids, px, grid, torch.arange(len(ids)))
    assert (plain - ref).abs().max() > 0.1
    monkeypatch.setattr(Qwen3_5VLArch, "mrope_interleaved", False)
    assert model.arch.mrope_axes == (0, 0, 1, 1, 1, 2, 2, 2)
    contiguous = image_prompt_logits(runner, ids, px, grid, positions)
    assert (contiguous - ref).abs().max() > 0.1
    monkeypatch.undo()
    text = torch.randint(0, 190, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=text[None]).logits[0].float()
    ours = runner_logits(runner, text)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_moe_image_prompt_logits_equal_transformers(tmp_path):
    """Qwen3.5-MoE's class: the same tower and M-RoPE over the experts' language model."""
    hf = make_hf(moe=True)
    save(hf, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert type(runner.model) is qwen3_next.Qwen3_5MoeForConditionalGeneration
    ids = image_prompt(GRIDS[1:])
    px, grid = pixels(GRIDS[1:])
    types = (ids == IMAGE).int()[None]
    positions = hf.model.get_rope_index(ids[None], types, image_grid_thw=grid)[0][:, 0]
    with torch.inference_mode():
        ref = hf(input_ids=ids[None], pixel_values=px, image_grid_thw=grid,
                 mm_token_type_ids=types).logits[0].float()  # fmt: skip
    ours = image_prompt_logits(runner, ids, px, grid, positions)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_mrope_table_equals_transformers_rotary():
    """The released sizes (head_dim 256, factor 0.25: 32 frequencies, transformers' default
    sections (11, 11, 10)): each token's cos and sin equal transformers' Qwen3.5 rotary at
    random (temporal, height, width) positions."""
    text = {**TEXT, "num_hidden_layers": 1, "layer_types": ["full_attention"], "head_dim": 256,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                "partial_rotary_factor": 0.25}}  # fmt: skip
    config = transformers.Qwen3_5Config(text_config=text, vision_config=VISION, **TOKENS)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5ForConditionalGeneration.arch_from_hf(config))
    model.init_buffers()
    assert model.arch.mrope_section == (11, 11, 10)
    positions = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(3))
    rotary = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(
        config.text_config
    )
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None])  # (1, 20, 64)
    table = model.mrope_table(positions)  # (20, 64): [cos | sin] of 32 frequencies
    assert torch.allclose(table[:, :32], cos[0, :, :32], atol=1e-6)
    assert torch.allclose(table[:, 32:], sin[0, :, :32], atol=1e-6)


def test_image_layout_and_refusals(checkpoint):
    """The layout from config.json's dict (the processor's: Qwen3-VL's grid); a config
    whose sections do not cover the rotated frequencies is refused."""
    hf, path = checkpoint
    config = json.loads((path / "config.json").read_text())
    assert Qwen3_5ForConditionalGeneration.takes_images(config)
    assert qwen3_next.qwen_vl_image_layout(config) == (IMAGE, 2)
    assert qwen3_next.qwen_vl_image_layout({"model_type": "qwen3_5"}) == (248056, 2)
    bad = copy.deepcopy(hf.config)
    bad.text_config.rope_parameters["mrope_section"] = [2, 2, 2]
    with pytest.raises(ValueError, match="mrope_section"):
        Qwen3_5ForConditionalGeneration.arch_from_hf(bad)


def test_checkpoint_without_tower_is_served_as_text(checkpoint, tmp_path):
    """No ``model.visual.*`` tensors: the language model alone (no images, no M-RoPE), its
    text logits transformers'."""
    hf, path = checkpoint
    shutil.copytree(path, tmp_path / "text")
    state = load_file(path / "model.safetensors")
    text = {k: v for k, v in state.items() if not k.startswith("model.visual.")}
    save_file(text, tmp_path / "text" / "model.safetensors", metadata={"format": "pt"})
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path / "text"), max_model_len=128))
    assert runner.model.visual is None
    assert not runner.model.supports_images and not runner.model.uses_mrope
    ids = torch.randint(0, 190, (30,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    assert torch.allclose(runner_logits(runner, ids), ref, atol=1e-4)
    with pytest.raises(ValueError, match="without images"):
        runner.model.embed_images(*pixels(GRIDS[:1]))


def image(seed: int, size) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (*size, 3), dtype=np.uint8))


def reference(hf, path, images) -> tuple[list[int], list[int], list[float]]:
    """(the prompt's ids as Qwen3-VL's processor expands them: each image's placeholder,
    t * h * w / 4 image tokens; transformers' greedy tokens; their logprobs)."""
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    out = processor(images=images, return_tensors="pt")
    grids = out["image_grid_thw"]
    counts = iter(int(t * h * w) // 4 for t, h, w in grids.tolist())
    ids = [x for p in PROMPT for x in ([IMAGE] * next(counts) if p == IMAGE else [p])]
    types = (torch.tensor([ids]) == IMAGE).int()
    return ids, *hf_greedy(hf, ids, pixel_values=out["pixel_values"], image_grid_thw=grids,
                           mm_token_type_ids=types)  # fmt: skip


def test_engine_greedy_equals_transformers(checkpoint):
    """The engine (prompt ids, two images): whole and in chunks of 5 (one ending inside
    the text after an image), then the same request again, restored from the recurrent
    states' checkpoint at 20 tokens (inside the second image, whose last row the encoder
    cache gives back); and other images, other logprobs."""
    hf, path = checkpoint
    images = [image(0, (70, 50)), image(1, (56, 112))]  # 4 x 4 and 4 x 8 patches
    other = [image(2, (70, 50)), image(3, (56, 112))]
    ids, *want = reference(hf, path, images)
    assert len(ids) == 23 and ids[13:21] == [IMAGE] * 8
    request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": images}}
    other_want = reference(hf, path, other)[1:]
    check_engine_images(path, request, other, ids, want, other_want, skip_tokenizer_init=True,
                        kv_cache_memory="16MiB")  # fmt: skip
