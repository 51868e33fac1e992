"""Tiled images through the engine on a tiny random SmolVLM / Idefics3: the image processor
cuts an image into tiles plus the whole image, and the prompt holds each tile's markers
(``<fake_token_around_image><row_r_col_c>``) around its image tokens. The engine builds
the same prompt as transformers' ``Idefics3Processor`` and gives ``generate``'s greedy
tokens, whole and with the tiles cut across prefill chunks (rows of markers between
embeddings), and again from the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.model_executor.test_idefics3 import image_processor, make_hf, save
from tests.multimodal.utils import check_engine_images, hf_greedy
from tests.utils import copy_benchmark_tokenizer
from vllm import SamplingParams

MARKERS = ["<fake_token_around_image>", "<global-img>", "<image>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = "Look at <image> and say"


@pytest.fixture(scope="module", params=["smolvlm", "idefics3"])
def model(request, tmp_path_factory):
    return build_model(request.param, tmp_path_factory.mktemp(request.param))


def build_model(kind: str, path):
    """(folder, transformers model, its processor): SmolLM2's tokenizer with the markers
    added, the image token among them; the connector scaled up so that the image moves
    the logprobs."""
    copy_benchmark_tokenizer(path, chat_template=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(path)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    hf = make_hf(kind, text={"vocab_size": len(tokenizer)}, image_token_id=image_id)
    with torch.no_grad():
        hf.model.connector.modality_projection.proj.weight.mul_(20)
    save(hf, kind, path)
    processor = transformers.Idefics3Processor(
        image_processor=image_processor(kind), tokenizer=tokenizer, image_seq_len=4
    )
    return path, hf, processor


def image(seed: int, size=(50, 70)) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (*size, 3), dtype=np.uint8))


def reference(model, img: Image.Image) -> tuple[list[int], list[int], list[float]]:
    """(transformers' prompt ids for ``PROMPT`` with ``img``, its greedy tokens, their
    logprobs: a tiny random model's distribution is nearly flat, so the logprobs, not the
    tokens, show that the image was read, and read right)."""
    _, hf, processor = model
    enc = processor(text=PROMPT, images=[[img]], return_tensors="pt")
    ids = enc.pop("input_ids")[0].tolist()
    return ids, *hf_greedy(hf, ids, **enc)


@pytest.mark.parametrize("size", [(50, 70), (20, 60)])  # 2 x 2 and 1 x 2 tiles, + global
def test_tiled_prompt_and_greedy_tokens_equal_transformers(model, size):
    img, other_img = image(0, size), image(1, size)
    ids, *want = reference(model, img)
    request = {"prompt": PROMPT, "multi_modal_data": {"image": img}}
    check_engine_images(model[0], request, other_img, ids, want, reference(model, other_img)[1:])
