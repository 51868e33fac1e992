"""Gemma 4's images (``models/gemma4.py``'s ``Gemma4ForConditionalGeneration``, its tower
``models/gemma4_vision.py``) against transformers' on a tiny random checkpoint (per-layer
inputs, KV-shared layers, the MoE block; a tower with fewer KV heads, clipped linears and
standardized rows), images prepared by transformers' ``Gemma4ImageProcessorPil`` at their
own aspect ratio: the image rows equal ``get_image_features``; the logits of a prompt
holding two images equal transformers' with each image's tokens attending both ways in
the sliding layers (``use_bidirectional_attention`` "vision", ``mm_token_type_ids``) and
causally without it; the engine expands each image token as ``Gemma4Processor`` does and
gives transformers' greedy tokens and logprobs, again from the prefix cache; audio and
video are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.model_executor.test_gemma4 import FEATURES, gemma4_config, randomized
from tests.tiny_models import cache_layout, load_cpu_runner
from vllm.config import ModelConfig, SchedulerConfig, VllmConfig
from vllm.model_executor.models.gemma4 import Gemma4ForConditionalGeneration
from vllm.v1.attention.backends.abstract import attend_both_ways

IMAGE, VIDEO, AUDIO, BOI, EOI = 95, 94, 93, 92, 91
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, position_embedding_size=64, patch_size=4,
              pooling_kernel_size=2, standardize=True, use_clipped_linears=True)  # fmt: skip
# 4-pixel patches pooled 2 x 2, at most 70 rows an image: a 40 x 24 image is resized to
# 80 x 48 pixels (20 x 12 patches, 60 rows), a 32 x 32 one to 64 x 64 (64 rows).
PROCESSOR = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)


def make_hf(bidirectional: str | None = "vision", **text) -> torch.nn.Module:
    """A random tiny Gemma 4 with a vision tower (torch seed 0): norms, clip bounds, the
    standardization and the embedder drawn so that a misplaced one shows."""
    text = gemma4_config(*FEATURES, use_bidirectional_attention=bidirectional,
                         **{"max_position_embeddings": 256, **text})  # fmt: skip
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=VISION, audio_config=None,
        image_token_id=IMAGE, video_token_id=VIDEO, audio_token_id=AUDIO,
        boi_token_id=BOI, eoi_token_id=EOI,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = randomized(transformers.Gemma4ForConditionalGeneration(config))
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith(("input_min", "output_min")):
                t.fill_(-2.0)
            elif name.endswith(("input_max", "output_max")):
                t.fill_(2.0)
            elif name.endswith("std_bias"):
                t.normal_(0.0, 0.5)
            elif name.endswith("std_scale"):
                t.uniform_(0.5, 1.5)
            elif name.endswith("embedding_projection.weight"):
                t.normal_(0.0, 1.0)  # so that images move the logits
    return hf


def save(hf, path) -> None:
    hf.save_pretrained(path)
    transformers.Gemma4ImageProcessorPil(**PROCESSOR).save_pretrained(path)


def images() -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8))
            for h, w in ((24, 40), (32, 32))]  # fmt: skip


def hf_pixels(imgs) -> dict[str, torch.Tensor]:
    """transformers' image inputs: padded patches, positions, rows per image."""
    return transformers.Gemma4ImageProcessorPil(**PROCESSOR)(images=imgs, return_tensors="pt")


def our_patches(pixels) -> tuple[torch.Tensor, torch.Tensor]:
    """The images' patches without padding, concatenated, and their (1, h, w) grids."""
    patches, grids = [], []
    for values, pos in zip(pixels["pixel_values"], pixels["image_position_ids"], strict=True):
        real = (pos != -1).all(-1)
        patches.append(values[real])
        width, height = (int(v) + 1 for v in pos[real].max(0).values)
        grids.append((1, height, width))
    return torch.cat(patches), torch.tensor(grids)


def prompt(rows: list[int], expanded: bool = True) -> torch.Tensor:
    """Text, then per image its frame (boi, ``rows`` image tokens, eoi; not ``expanded``:
    the one image token that names it) and text."""
    g = torch.Generator().manual_seed(1)
    parts = [torch.randint(0, EOI, (5,), generator=g)]
    for n in rows:
        frame = [BOI, *[IMAGE] * n, EOI] if expanded else [IMAGE]
        parts += [torch.tensor(frame), torch.randint(0, EOI, (7,), generator=g)]
    return torch.cat(parts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embed_images_equal_transformers(dtype, tmp_path):
    """Both images at once (80 x 48 and 64 x 64 pixels: 60 and 64 rows), and one alone;
    in bf16 within its rounding along the tower."""
    hf = make_hf()
    save(hf, tmp_path)
    config = ModelConfig(model=str(tmp_path), max_model_len=256, dtype=dtype)
    model = load_cpu_runner(config).model
    assert type(model) is Gemma4ForConditionalGeneration
    assert not any("audio" in n for n, _ in model.named_parameters())
    pixels = hf_pixels(images())
    assert pixels["num_soft_tokens_per_image"].tolist() == [60, 64]
    hf = hf.to(getattr(torch, dtype))
    with torch.inference_mode():
        ref = hf.get_image_features(pixels["pixel_values"], pixels["image_position_ids"])
    ref = torch.cat(ref.pooler_output).float()
    patches, grids = our_patches(pixels)
    assert grids.tolist() == [[1, 12, 20], [1, 16, 16]]
    ours = model.embed_images(patches.double(), grids)
    assert ours.shape == (124, 64) and ours.dtype == getattr(torch, dtype)
    assert ref.abs().mean() > 0.1
    if dtype == "bfloat16":
        assert (ours.float() - ref).abs().max() <= 0.03 * ref.abs().max()
        return
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    alone = model.embed_images(patches[240:], grids[1:])
    assert torch.allclose(alone, ref[60:], atol=1e-5)


def test_vision_configs_and_takes_images():
    """A tower it cannot run is refused; a config without a vision_config takes none."""
    from vllm.model_executor.models.gemma4_vision import Gemma4VisionArch

    config = make_hf().config
    assert Gemma4ForConditionalGeneration.takes_images(config)
    assert Gemma4ForConditionalGeneration.takes_images(config.to_dict())
    assert not Gemma4ForConditionalGeneration.takes_images({"model_type": "gemma4"})
    for field, value, message in (
        ("hidden_activation", "silu", "hidden_activation 'silu'"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 1.0}, "only 'axial'"),
        ("num_key_value_heads", 3, "3 KV heads do not divide 2"),
    ):
        vision = transformers.Gemma4VisionConfig(**VISION)
        setattr(vision, field, value)  # the config itself turns any rope_type to axial
        with pytest.raises(ValueError, match=message):
            Gemma4VisionArch.from_hf(vision, 64)


@pytest.mark.parametrize(
    "bidirectional, hybrid, backend",
    [(None, True, "sdpa"), ("vision", True, "sdpa"), ("vision", False, "sdpa"),
     ("vision", False, "varlen")],
)  # fmt: skip
def test_image_prompt_logits_equal_transformers(
    bidirectional, hybrid, backend, tmp_path, monkeypatch
):
    """Two images (60 and 64 tokens, past the 12-token window) in one prompt, computed
    the engine's way (the image rows written over the image tokens' embeddings, each
    image's rows marked to attend both ways as the model runner marks them): transformers'
    logits, with ``mm_token_type_ids`` (its bidirectional mask, the sliding layers only);
    "vision"'s differ from the causal ones, and the text's from both. With the hybrid KV
    cache (sliding and global layers in groups of their own) and without it (one
    metadata for all), on torch_sdpa and on TORCH_FLASH_ATTN's varlen path (its kernel
    emulated: the spans kept apart in ``both_ways``)."""
    hf = make_hf(bidirectional)
    save(hf, tmp_path)
    config = VllmConfig(
        model_config=ModelConfig(model=str(tmp_path)),
        scheduler_config=SchedulerConfig(
            max_model_len=256, disable_hybrid_kv_cache_manager=not hybrid
        ),
    )
    runner = load_cpu_runner(config)
    if backend == "varlen":
        from tests.v1.attention.test_torch_flash import install, ref_varlen_attn
        from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend

        install(monkeypatch, ref_varlen_attn)
        a = runner.arch
        runner.attn_backend = TorchFlashAttentionBackend(
            a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, "cpu", 16
        )
        runner.install_attention_backend()
    assert runner.kv_groups.num_groups == (2 if hybrid else 1)
    model = runner.model
    assert model.bidirectional_image_attention == (bidirectional == "vision")
    assert ("bidirectional_spans" in model.attention_features) == (bidirectional == "vision")
    pixels = hf_pixels(images())
    ids = prompt([60, 64])
    image_rows = (ids == IMAGE).nonzero()[:, 0]
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner, 16))])
    if model.bidirectional_image_attention:
        first, second = image_rows[:60], image_rows[60:]
        attend_both_ways(meta, [(int(r[0]), int(r[-1]) + 1) for r in (first, second)])
    with torch.inference_mode():
        embeds = model.embed_input_ids(ids)
        embeds[image_rows] = model.embed_images(*our_patches(pixels))
        hidden = model(ids, torch.arange(len(ids)), meta, runner.kv_caches, inputs_embeds=embeds)
        ours = model.compute_logits(hidden)
        inputs = dict(input_ids=ids[None], pixel_values=pixels["pixel_values"],
                      image_position_ids=pixels["image_position_ids"])  # fmt: skip
        ref = hf(**inputs, mm_token_type_ids=(ids == IMAGE).long()[None]).logits[0].float()
        causal = hf(**inputs).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    if bidirectional == "vision":
        assert (ref - causal).abs().max() > 1e-2
    meta = runner.metadata_builder.build_metadata([(0, len(ids), cache_layout(runner, 16))])
    with torch.inference_mode():
        text = model.compute_logits(model(ids, torch.arange(len(ids)), meta, runner.kv_caches))
    assert (text - ref).abs().max() > 1e-2


def reference(hf, ids: torch.Tensor, pixels, max_tokens: int = 6):
    """transformers' greedy tokens and their logprobs, each from a whole forward over the
    prompt and the tokens so far (its bidirectional image mask: ``mm_token_type_ids``)."""
    tokens, logprobs = [], []
    seq = ids[None]
    for _ in range(max_tokens):
        with torch.inference_mode():
            logits = hf(
                input_ids=seq, pixel_values=pixels["pixel_values"],
                image_position_ids=pixels["image_position_ids"],
                mm_token_type_ids=(seq == IMAGE).long(),
            ).logits  # fmt: skip
        row = torch.log_softmax(logits[0, -1].float(), -1)
        tokens.append(int(row.argmax()))
        logprobs.append(row[tokens[-1]].item())
        seq = torch.cat([seq, torch.tensor([[tokens[-1]]])], 1)
    return tokens, logprobs


def test_engine_greedy_with_images_equals_transformers(tmp_path):
    """The engine on a prompt naming two images with the image token: the prompt ids
    transformers' processor makes (boi, a token per row, eoi), its greedy tokens and
    logprobs, again from the prefix cache; audio and video refused with a 400."""
    from tests.multimodal.utils import check_greedy
    from tests.utils import copy_benchmark_tokenizer
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    hf = make_hf()
    save(hf, tmp_path)
    copy_benchmark_tokenizer(tmp_path)
    imgs = images()
    ids = prompt([60, 64])
    named = prompt([60, 64], expanded=False)
    want = reference(hf, ids, hf_pixels(imgs))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    request = {"prompt_token_ids": named.tolist(), "multi_modal_data": {"image": imgs}}
    llm = LLM(model=str(tmp_path), max_model_len=256, kv_cache_memory="16MiB", block_size=4,
              enable_prefix_caching=True)  # fmt: skip
    try:
        first, again = llm.generate(request, greedy), llm.generate(request, greedy)
        for modality, value in (("audio", np.zeros(1600)), ("video", [imgs[0]])):
            with pytest.raises(VLLMValidationError, match=f"modality '{modality}' is not"):
                llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {modality: value}})
    finally:
        llm.shutdown()
    assert first[0].prompt_token_ids == ids.tolist()
    assert again[0].num_cached_tokens >= len(ids) - 4
    for got in (first, again):
        check_greedy(got, *want)


def test_missing_clip_bounds_are_infinite():
    """A clipped linear's bound the checkpoint lacks clamps nothing (transformers' initial
    value); the tower's other tensors are required."""
    from vllm.model_executor.models.gemma4_vision import Gemma4VisionArch, Gemma4VisionModel

    hf = make_hf()
    sd = hf.state_dict()
    key = "model.vision_tower.encoder.layers.0.mlp.up_proj.output_max"
    del sd[key]
    with torch.no_grad():
        hf.get_buffer(key).fill_(float("inf"))
    tower = Gemma4VisionModel(Gemma4VisionArch.from_hf(hf.config.vision_config, 64))
    tower.load_weights(sd)
    pixels = hf_pixels(images()[:1])
    with torch.inference_mode():
        ref = hf.get_image_features(pixels["pixel_values"], pixels["image_position_ids"])
        ours = tower(*our_patches(pixels))
    ref = ref.pooler_output[0]
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    del sd["model.embed_vision.embedding_projection.weight"]
    with pytest.raises(ValueError, match="lacks 1 vision tensors"):
        tower.load_weights(sd)
