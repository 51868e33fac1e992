"""Mistral 3's images through the engine on a tiny random model (tests/model_executor/
test_mistral3.py's): each image resized by the model's image processor to multiples of
the merged patch and encoded at its own size (two sizes in one prompt: the model runner
hands the encoder a list), its ``[IMG]`` placeholder expanded to rows of ``[IMG]``
between ``[IMG_BREAK]`` tokens and an ``[IMG_END]``, of which only the ``[IMG]`` tokens
take the image's rows. The engine builds transformers' prompt and gives ``generate``'s
greedy tokens and logprobs, whole, in prefill chunks of 5 (breaks and image rows cut
across chunks) and again from the prefix cache; other images change them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.model_executor.test_mistral3 import image_tokens, make_hf, padded, save
from tests.multimodal.utils import check_engine_images, hf_greedy, image_parts
from tests.utils import copy_benchmark_tokenizer
from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError

MARKERS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = "Look at [IMG] and [IMG] then say"
MERGED_PATCH = {"height": 8, "width": 8}  # as PixtralProcessor passes it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("mistral3"))


def build_model(path):
    """(folder, transformers model, its tokenizer, its image processor): SmolLM2's tokenizer
    (and chat template) with the markers added; the projector scaled up so that the images
    move the logprobs."""
    copy_benchmark_tokenizer(path, chat_template=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(path)
    image_id = tokenizer.convert_tokens_to_ids("[IMG]")
    hf = make_hf(text={"vocab_size": len(tokenizer)}, image_token_index=image_id)
    with torch.no_grad():
        hf.model.multi_modal_projector.linear_2.weight.mul_(20)
    save(hf, path)
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    return path, hf, tokenizer, processor


def image(seed: int, size) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (*size, 3), dtype=np.uint8))


def reference(model, images) -> tuple[list[int], list[int], list[float]]:
    """(transformers' prompt ids for ``PROMPT`` with ``images``: each [IMG] expanded by
    PixtralProcessor's rule, then tokenized; its greedy tokens; their logprobs)."""
    _, hf, tokenizer, processor = model
    out = processor(images=images, return_tensors="pt", patch_size=MERGED_PATCH)
    markers = tokenizer.convert_tokens_to_ids(MARKERS)
    sizes = out["image_sizes"].tolist()
    parts = PROMPT.split("[IMG]")
    ids = tokenizer.encode(parts[0], add_special_tokens=False)
    for (height, width), text in zip(sizes, parts[1:], strict=True):
        ids += image_tokens(height, width, markers)
        ids += tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.encode(PROMPT, add_special_tokens=False).count(markers[0]) == 2
    pixels = [x[None, :, :h, :w] for x, (h, w) in zip(out["pixel_values"], sizes, strict=True)]
    px, image_sizes = padded(pixels)  # transformers' batch: padded, with the sizes
    return ids, *hf_greedy(hf, ids, pixel_values=px, image_sizes=image_sizes)


def test_two_image_sizes_greedy_tokens_equal_transformers(model):
    """A 50 x 30 and a 20 x 50 (w x h) image: resized to 40 x 24 and 16 x 40 pixels, 3 rows
    of 5 and 5 rows of 2 image tokens."""
    images = [image(0, (30, 50)), image(1, (50, 20))]
    other = [image(2, (30, 50)), image(3, (50, 20))]
    ids, *want = reference(model, images)
    request = {"prompt": PROMPT, "multi_modal_data": {"image": images}}
    check_engine_images(model[0], request, other, ids, want, reference(model, other)[1:])


def test_skip_tokenizer_init_refuses_images(model):
    """Without a tokenizer the break and end tokens' ids are unknown (the config names
    none): an image is refused, naming multi_modal_data; text goes on."""
    llm = LLM(model=str(model[0]), max_model_len=128, skip_tokenizer_init=True)
    try:
        image_id = model[2].convert_tokens_to_ids("[IMG]")
        img = image(0, (30, 50))
        request = {"prompt_token_ids": [5, image_id, 6], "multi_modal_data": {"image": img}}
        with pytest.raises(VLLMValidationError, match="IMG_BREAK") as e:
            llm.generate(request, GREEDY)
        assert e.value.param == "multi_modal_data"
        assert len(llm.generate({"prompt_token_ids": [5, 6]}, GREEDY)[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()


def test_chat_image_parts_reach_the_placeholders(model):
    """LLM.chat with image_url parts (SmolLM2's template takes text: the placeholder
    ``[IMG]`` is written before the message's text) gives the tokens of the same prompt
    with the same images through generate."""
    images = [image(0, (30, 50)), image(1, (50, 20))]
    messages = [{"role": "user", "content": image_parts(images, "Which?")}]
    llm = LLM(model=str(model[0]), max_model_len=128)
    try:
        chat = llm.chat(messages, GREEDY)[0]
        direct = llm.generate({"prompt": chat.prompt, "multi_modal_data": {"image": images}},
                              GREEDY)[0]  # fmt: skip
    finally:
        llm.shutdown()
    assert "[IMG]\n[IMG]\nWhich?" in chat.prompt
    assert chat.prompt_token_ids.count(model[2].convert_tokens_to_ids("[IMG_END]")) == 2
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
