"""Qwen2-VL and Qwen2.5-VL images through the engine (tiny random models of
tests/model_executor/test_qwen2_vl.py, prompts as token ids): each image sized by the
model's processor into a patch grid, its placeholder expanded to the grid's tokens, the
prompt's M-RoPE positions (three rows where the images are) carried through prefill
chunks that cut the images, and the decode steps' positions shifted by what the images
took. The greedy tokens and their logprobs equal transformers' ``generate`` on the same
pixels, whole, in chunks of 5 and from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.model_executor.test_qwen2_vl import END, IMAGE, START, VISION, make_hf, save
from tests.multimodal.utils import check_engine_images, hf_greedy
from vllm import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = [5, 6, 7, START, IMAGE, END, 8, 9, START, IMAGE, END, 10, 11]  # two images


@pytest.fixture(scope="module", params=list(VISION))
def model(request, tmp_path_factory):
    return build_model(request.param, tmp_path_factory.mktemp(request.param))


def build_model(name: str, path):
    """(folder, transformers model, its image processor): the merger's output scaled up
    so that the images move the logprobs."""
    hf = make_hf(name)
    with torch.no_grad():
        hf.model.visual.merger.mlp[2].weight.mul_(20)
    save(hf, path)
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    return path, hf, processor


def image(seed: int, size) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (*size, 3), dtype=np.uint8))


def reference(model, images) -> tuple[list[int], list[int], list[float]]:
    """(transformers' prompt ids: each image's placeholder expanded to its grid's tokens;
    its greedy tokens; their logprobs)."""
    _, hf, processor = model
    out = processor(images=images, return_tensors="pt")
    grids = out["image_grid_thw"]
    counts = iter(int(t * h * w) // 4 for t, h, w in grids.tolist())
    ids = [x for p in PROMPT for x in ([IMAGE] * next(counts) if p == IMAGE else [p])]
    mm_token_type_ids = (torch.tensor([ids]) == IMAGE).int()
    return ids, *hf_greedy(hf, ids, pixel_values=out["pixel_values"], image_grid_thw=grids,
                           mm_token_type_ids=mm_token_type_ids)  # fmt: skip


def test_images_on_m_rope_equal_transformers(model):
    images = [image(0, (70, 50)), image(1, (56, 112))]  # grids of 4 x 4 and 4 x 8 patches
    other = [image(2, (70, 50)), image(3, (56, 112))]
    ids, *want = reference(model, images)
    request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": images}}
    other_want = reference(model, other)[1:]
    check_engine_images(model[0], request, other, ids, want, other_want, skip_tokenizer_init=True)
