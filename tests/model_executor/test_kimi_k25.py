"""Kimi K2.5 (``models/kimi_k25.py``) against transformers' ``Kimi_K25ForConditionalGeneration``
on a tiny random fp32 checkpoint (a DeepSeek-V3 language model, a 2-layer tower of 4-pixel
patches over a 4 x 4 position table): text logits, image rows (grids of the table's size,
larger and non-square, smaller), logits of a prompt with images, the Hub's original tensor
names, our image processor's sizing and patch layout, and the engine's greedy tokens with
images equal to transformers' ``generate`` on the same pixels."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.tiny_models import (
    cache_layout,
    check_image_logits,
    load_cpu_runner,
    perturbed,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.kimi_k25 import (
    KimiK25ForConditionalGeneration,
    KimiK25ImageProcessor,
    navit_size,
    qwen_vl_image_layout,
)
from vllm.model_executor.models.registry import ModelRegistry

IMAGE = 190
TEXT = dict(model_type="kimi_k2", vocab_size=200, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=56, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, max_position_embeddings=256,
            n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
            tie_word_embeddings=False)  # fmt: skip
VISION = dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2,
              num_hidden_layers=2, hidden_size=32, intermediate_size=48)  # fmt: skip
# At most 8 patches a side and 48 patches an image.
PROCESSOR = dict(size={"max_height": 8, "max_width": 8}, max_patches=48, patch_size=4,
                 merge_size=2, image_processor_type="Kimi_K25ImageProcessor")  # fmt: skip
# The table's own size, larger and non-square (bicubic up), smaller (down).
GRIDS = [(1, 4, 4), (1, 6, 8), (1, 2, 2)]


def make_config(**top):
    return transformers.Kimi_K25Config(
        text_config=dict(TEXT), vision_config=dict(VISION), projection_hidden_size=32,
        image_token_id=IMAGE, video_token_id=191, tie_word_embeddings=False, **top,
    )  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model, its saved folder): biases and norms perturbed, a routing bias
    that chooses, the projector's output scaled up so that images move the logits."""
    torch.manual_seed(0)
    hf = perturbed(transformers.Kimi_K25ForConditionalGeneration(make_config()))
    with torch.no_grad():
        for name, p in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
        hf.model.mm_projector.out_proj.weight.mul_(20)
        hf.model.vision_tower.patch_embed.pos_emb.position_embeddings.normal_()
    path = tmp_path_factory.mktemp("kimi_k25")
    hf.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return hf, path


@pytest.fixture(scope="module")
def runner(checkpoint):
    return load_cpu_runner(ModelConfig(model=str(checkpoint[1]), max_model_len=128))


def pixels(grids, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(t * h * w for t, h, w in grids)
    px = torch.randn(n, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    return px, torch.tensor(grids)


def hf_rows(hf, px, grid) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat(hf.model.get_image_features(px, grid).pooler_output)


def test_resolves_and_layout(checkpoint):
    hf, path = checkpoint
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["model_type"] == "deepseek_v3"  # kimi_k2 read as V3
    for arch in ("KimiK25ForConditionalGeneration", "Kimi_K25ForConditionalGeneration"):
        cls, _ = ModelRegistry.resolve_model_cls(make_config(architectures=[arch]))
        assert cls is KimiK25ForConditionalGeneration
    assert qwen_vl_image_layout(hf.config) == qwen_vl_image_layout(config) == (IMAGE, 2)
    assert KimiK25ForConditionalGeneration.takes_images(config)
    text_only = {k: v for k, v in config.items() if k != "vision_config"}
    assert not KimiK25ForConditionalGeneration.takes_images(text_only)
    model = KimiK25ForConditionalGeneration(KimiK25ForConditionalGeneration.arch_from_hf(text_only))
    assert model.vision_tower is None and not model.supports_images


def test_text_logits_equal_transformers(checkpoint, runner):
    hf, _ = checkpoint
    model = runner.model
    assert type(model) is KimiK25ForConditionalGeneration and model.supports_images
    assert (runner.arch.num_kv_heads, runner.arch.head_dim) == (1, 56 + 8)  # one latent row
    ids = torch.randint(0, 190, (60,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
    ours = runner_logits(runner, ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_embed_images_equal_transformers(checkpoint, runner):
    hf, _ = checkpoint
    px, grid = pixels(GRIDS)
    ref = hf_rows(hf, px, grid)
    ours = runner.model.embed_images(px.double(), grid)  # cast to the model's dtype inside
    assert ours.shape == (4 + 12 + 1, 64) and ours.dtype == torch.float32
    assert ref.abs().mean() > 0.1
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    alone = runner.model.embed_images(px[16:64].flatten(1), grid[1:2])  # flat patches too
    assert torch.allclose(alone, ref[4:16], atol=1e-5)
    with pytest.raises(ValueError, match="grid_thw"):
        runner.model.embed_images(px[:12], torch.tensor([[1, 3, 4]]))


def test_image_prompt_logits_equal_transformers(checkpoint, runner):
    """Text around two images (12 and 4 tokens): every position's logits equal
    transformers'."""
    hf, _ = checkpoint
    grids = GRIDS[1::-1]  # (1, 6, 8), then (1, 4, 4)
    px, grid = pixels(grids, seed=5)
    ids = torch.tensor([3, 9, *[IMAGE] * 12, 40, 41, 7, *[IMAGE] * 4, 11, 12, 13])
    model = runner.model
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner))])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        rows = (ids == IMAGE).nonzero()[:, 0]
        embeds.index_copy_(0, rows, model.embed_images(px, grid))
        hidden = model(ids, torch.arange(len(ids)), meta, runner.kv_caches, inputs_embeds=embeds)
        ours = model.compute_logits(hidden)
    check_image_logits(runner, hf, ids, ours, pixel_values=px, image_grid_thw=grid)


def hub_layout(sd: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """transformers 5's tensors renamed back to the Hub's original names, q and k rows
    re-paired interleaved and fused with v into ``wqkv``."""

    def interleave(t):
        half = t.shape[0] // heads // 2
        return t.reshape(heads, 2, half, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    out = {}
    for key, t in sd.items():
        if key.startswith("model.language_model."):
            out["language_model.model." + key.removeprefix("model.language_model.")] = t
        elif key == "lm_head.weight":
            out["language_model.lm_head.weight"] = t
        elif key.startswith("model.mm_projector."):
            name = key.removeprefix("model.mm_projector.")
            out[
                "mm_projector." + name.replace("in_proj", "proj.0").replace("out_proj", "proj.2")
            ] = t
        elif key.startswith("model.vision_tower.layers."):
            i, _, rest = key.removeprefix("model.vision_tower.layers.").partition(".")
            p = f"vision_tower.encoder.blocks.{i}."
            leaf = rest.rpartition(".")[2]
            if rest.startswith("attn.q_proj"):
                q, k, v = (sd[f"model.vision_tower.layers.{i}.attn.{n}_proj.{leaf}"] for n in "qkv")
                out[f"{p}wqkv.{leaf}"] = torch.cat([interleave(q), interleave(k), v])
            elif not rest.startswith(("attn.k_proj", "attn.v_proj")):
                for new, old in (("norm1", "norm0"), ("norm2", "norm1"), ("mlp.fc1", "mlp.fc0"),
                                 ("mlp.fc2", "mlp.fc1"), ("attn.proj", "wo")):  # fmt: skip
                    if rest.startswith(new + "."):
                        rest = old + rest[len(new) :]
                        break
                out[p + rest] = t
        elif key == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
            out["vision_tower.patch_embed.pos_emb.weight"] = t
        elif key.startswith("model.vision_tower.final_layernorm"):
            out["vision_tower.encoder." + key.removeprefix("model.vision_tower.")] = t
        else:  # the patch embedding
            out[key.removeprefix("model.")] = t
    return out


def test_hub_layout_loads(checkpoint):
    """The Hub's original names (fused, interleaved wqkv): the same rows and logits."""
    hf, _ = checkpoint
    model = KimiK25ForConditionalGeneration(KimiK25ForConditionalGeneration.arch_from_hf(hf.config))
    sd = hub_layout(hf.state_dict(), VISION["num_attention_heads"])
    assert "vision_tower.encoder.blocks.1.wqkv.weight" in sd and "mm_projector.proj.2.bias" in sd
    model.load_weights(sd)
    px, grid = pixels(GRIDS)
    ours = model.embed_images(px, grid)
    ref = hf_rows(hf, px, grid)
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)


def image(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (height, width, 3), dtype=np.uint8))


def test_image_processor(checkpoint):
    """transformers' sizing; an image that needs no resize: its pixels normalised, padded
    with -1 (0 before normalising) at the bottom and right, in row-major patches."""
    assert navit_size(22, 30, 4, 2, 48, 8) == ((22, 30), (24, 32))  # fits: padded only
    assert navit_size(40, 50, 4, 2, 48, 8) == ((25, 31), (32, 32))  # over 48 patches
    assert navit_size(10, 100, 4, 2, 48, 8) == ((3, 32), (8, 32))  # over 8 a side
    assert navit_size(896, 1344, 14, 2, 16384, 512) == ((896, 1344), (896, 1344))
    processor = KimiK25ImageProcessor.from_folder(checkpoint[1])
    img = image(0, 30, 22)
    out = processor(images=[img, image(1, 50, 40)])
    assert out["image_grid_thw"].tolist() == [[1, 6, 8], [1, 8, 8]]
    assert out["pixel_values"].shape == (48 + 64, 3, 4, 4)
    x = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1) / 255 * 2 - 1
    full = -torch.ones(3, 24, 32)
    full[:, :22, :30] = x
    patches = full.reshape(3, 6, 4, 8, 4).permute(1, 3, 0, 2, 4).reshape(48, 3, 4, 4)
    assert torch.allclose(out["pixel_values"][:48], patches, atol=1e-6)
    # A request's lower max_patches: 22 x 30 pixels scaled by sqrt(12 / 35) to 12 x 17.
    assert processor(images=[img], max_patches=12)["image_grid_thw"].tolist() == [[1, 4, 6]]


def test_engine_greedy_with_images_equal_transformers(checkpoint):
    """Two images through the front end (our processor, each placeholder expanded to its
    grid's tokens) and the engine in 5-token chunks that cut them: greedy tokens and
    logprobs equal transformers' ``generate`` on the same pixels."""
    from vllm import LLM, SamplingParams

    hf, path = checkpoint
    images = [image(3, 30, 22), image(4, 50, 40)]  # 12 and 16 tokens
    prompt = [5, 17, IMAGE, 42, 33, IMAGE, 8, 99]
    out = KimiK25ImageProcessor.from_folder(path)(images=images)
    counts = iter(h * w // 4 for _, h, w in out["image_grid_thw"].tolist())
    ids = [x for p in prompt for x in ([IMAGE] * next(counts) if p == IMAGE else [p])]
    with torch.inference_mode():
        gen = hf.generate(torch.tensor([ids]), pixel_values=out["pixel_values"],
                          image_grid_thw=out["image_grid_thw"], max_new_tokens=6,
                          do_sample=False, output_logits=True,
                          return_dict_in_generate=True)  # fmt: skip
    want = gen.sequences[0, len(ids) :].tolist()
    want_logprobs = [
        torch.log_softmax(lg[0].float(), -1)[t].item()
        for lg, t in zip(gen.logits, want, strict=True)
    ]
    llm = LLM(model=str(path), skip_tokenizer_init=True, max_model_len=128,
              max_num_batched_tokens=5, block_size=4)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
        got = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}},
                           params)[0]  # fmt: skip
    finally:
        llm.shutdown()
    assert got.prompt_token_ids == ids
    assert list(got.outputs[0].token_ids) == want
    logprobs = [lp.logprob for lp in got.outputs[0].logprobs]
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4
