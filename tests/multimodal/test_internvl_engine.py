"""InternVL's images through the front end and the engine on a tiny random model
(tests/model_executor/test_internvl.py's shapes, SmolLM2's tokenizer with InternVL's
``<img>``, ``</img>``, ``<IMG_CONTEXT>`` and ``<video>`` added as its tokenizer names them):
each image cut into 28-pixel tiles by the model's image processor (``crop_to_patches``:
a 30 x 30 image one tile, a 60 x 30 one two and its thumbnail), its ``<IMG_CONTEXT>``
expanded to ``<img>``, 4 context tokens per tile, ``</img>``. The prompt ids and pixels
equal transformers' ``InternVLProcessor``'s for the same text (under the server's
``mm_processor_kwargs`` too; a request may lower ``max_patches``, not raise it); the
engine gives ``generate``'s greedy tokens and logprobs, whole, in prefill chunks of 5 (the
images cut across chunks) and again from the prefix cache; other images change them.
Without a tokenizer an image is refused; InternVL's chat template reaches the
placeholders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.model_executor.test_internvl import RMS_QK, TOKENS_PER_TILE, make_hf
from tests.multimodal.utils import check_engine_images, hf_greedy, image_parts
from tests.utils import copy_benchmark_tokenizer
from vllm import LLM, SamplingParams
from vllm.config import ModelConfig
from vllm.exceptions import VLLMValidationError
from vllm.model_executor.models.internvl import InternVLForConditionalGeneration
from vllm.multimodal.processing import ImageInputProcessor

CONTEXT = "<IMG_CONTEXT>"
# What InternVL's -hf tokenizer_config.json names (InternVLProcessor reads them).
SPECIAL = {"start_image_token": "<img>", "end_image_token": "</img>",
           "context_image_token": CONTEXT, "video_token": "<video>"}  # fmt: skip
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = f"Look at {CONTEXT}\nand {CONTEXT}\nthen say"
SIZES = [(30, 30), (60, 30)]  # (width, height): 1 tile; 2 tiles and the thumbnail


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("internvl"))


def build_model(path):
    """(folder, transformers model, transformers' InternVLProcessor): the projector's
    weights drawn large so that the images move the logprobs."""
    copy_benchmark_tokenizer(path, chat_template=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=SPECIAL)
    tokenizer.save_pretrained(path)
    hf = make_hf(
        text={"vocab_size": len(tokenizer), "max_position_embeddings": 256},
        vision=RMS_QK, image_token_id=tokenizer.context_image_token_id,
    )  # fmt: skip
    projector = hf.model.multi_modal_projector
    with torch.no_grad():
        for linear in (projector.linear_1, projector.linear_2):
            linear.weight.normal_(0.0, 1.0)
    hf.save_pretrained(path)
    transformers.GotOcr2ImageProcessorPil(
        size={"height": 28, "width": 28}, max_patches=6
    ).save_pretrained(path)
    image_processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    processor = ImageOnlyProcessor(image_processor, tokenizer, image_seq_length=TOKENS_PER_TILE)
    return path, hf, processor


class ImageOnlyProcessor(transformers.InternVLProcessor):
    """transformers' InternVLProcessor without its video processor (torchvision's, which
    the test machines may lack): its images and text as it processes them."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name != "video_processor" or argument is not None:
            return super().check_argument_for_proper_class(argument_name, argument)
        return None


def image(seed: int, size) -> Image.Image:
    """Four random colours in quarters (noise would average out over a tile's rows)."""
    rng = np.random.RandomState(seed)
    quarters = Image.fromarray(rng.randint(0, 255, (2, 2, 3), dtype=np.uint8))
    return quarters.resize(size, Image.NEAREST)


def reference(model, images, prompt=PROMPT):
    """(transformers' prompt ids, its greedy tokens, their logprobs)."""
    _, hf, processor = model
    out = processor(text=prompt, images=images, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    return ids, *hf_greedy(hf, ids, pixel_values=out["pixel_values"])


def ours(path, tokenizer, **fields) -> ImageInputProcessor:
    config = ModelConfig(model=str(path), **fields)
    return ImageInputProcessor(config, tokenizer, InternVLForConditionalGeneration)


@pytest.mark.parametrize(
    "kwargs,tiles",
    [({}, [1, 3, 7]), ({"crop_to_patches": False}, [1, 1, 1]), ({"max_patches": 2}, [1, 3, 1])],
)
def test_prompt_ids_and_tiles_equal_the_processor(model, kwargs, tiles):
    """Three images, their tiles by the server's mm_processor_kwargs (a 40 x 30 image: a
    2 x 3 grid and its thumbnail, one tile within 2): ids, tiles, and each feature's
    offset and length over its context tokens."""
    path, _, processor = model
    tokenizer = processor.tokenizer
    images = [image(0, SIZES[0]), image(1, SIZES[1]), image(2, (40, 30))]
    text = f"a {CONTEXT} b {CONTEXT}{CONTEXT} c"
    ref = processor(text=text, images=images, return_tensors="pt", **kwargs)
    proc = ours(path, tokenizer, mm_processor_kwargs=kwargs or None)
    ids, features = proc.process(tokenizer.encode(text, add_special_tokens=False), images)
    assert ids == ref["input_ids"][0].tolist()
    assert torch.equal(torch.cat([f.data for f in features]), ref["pixel_values"])
    context = tokenizer.context_image_token_id
    assert [f.data.shape[0] for f in features] == tiles
    for f, n in zip(features, tiles, strict=True):
        assert f.length == n * TOKENS_PER_TILE and f.is_embed is None
        assert ids[f.offset - 1] == tokenizer.start_image_token_id
        assert set(ids[f.offset : f.end]) == {context}
        assert ids[f.end] == tokenizer.end_image_token_id


def test_a_request_may_lower_max_patches_not_raise_it(model):
    path, _, processor = model
    proc = ours(path, processor.tokenizer)
    assert proc.request_kwargs({"max_patches": 2}) == {"max_patches": 2}
    with pytest.raises(VLLMValidationError, match="max_patches") as e:
        proc.request_kwargs({"max_patches": 40})
    assert e.value.param == "mm_processor_kwargs"


def test_two_image_sizes_greedy_tokens_equal_transformers(model):
    images = [image(0, SIZES[0]), image(1, SIZES[1])]
    other = [image(2, SIZES[0]), image(3, SIZES[1])]
    ids, *want = reference(model, images)
    context = model[2].tokenizer.context_image_token_id
    assert ids.count(context) == (1 + 3) * TOKENS_PER_TILE
    request = {"prompt": PROMPT, "multi_modal_data": {"image": images}}
    check_engine_images(model[0], request, other, ids, want, reference(model, other)[1:])


def test_skip_tokenizer_init_refuses_images(model):
    """Without a tokenizer the frame's ids are unknown (the config names none): an image
    is refused, naming multi_modal_data; text goes on."""
    llm = LLM(model=str(model[0]), max_model_len=128, skip_tokenizer_init=True)
    try:
        context = model[2].tokenizer.context_image_token_id
        request = {"prompt_token_ids": [5, context, 6],
                   "multi_modal_data": {"image": image(0, SIZES[0])}}  # fmt: skip
        with pytest.raises(VLLMValidationError, match="tokenizer") as e:
            llm.generate(request, GREEDY)
        assert e.value.param == "multi_modal_data"
        assert len(llm.generate({"prompt_token_ids": [5, 6]}, GREEDY)[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()


# InternVL3-hf's chat template (its chat_template.jinja): an image part is "<IMG_CONTEXT>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chat_template_image_parts_reach_the_placeholders(model):
    """LLM.chat with image_url parts under InternVL's template (it writes each image's
    ``<IMG_CONTEXT>``): the prompt ids transformers' processor makes of that text, and
    generate's tokens for it."""
    images = [image(0, SIZES[0]), image(1, SIZES[1])]
    messages = [{"role": "user", "content": image_parts(images, "Which?")}]
    llm = LLM(model=str(model[0]), max_model_len=128)
    try:
        chat = llm.chat(messages, GREEDY, chat_template=CHAT_TEMPLATE)[0]
        direct = llm.generate({"prompt": chat.prompt, "multi_modal_data": {"image": images}},
                              GREEDY)[0]  # fmt: skip
    finally:
        llm.shutdown()
    assert f"user\n{CONTEXT}\n{CONTEXT}\nWhich?<|im_end|>" in chat.prompt
    ids, tokens, _ = reference(model, images, chat.prompt)
    assert chat.prompt_token_ids == ids
    assert list(chat.outputs[0].token_ids) == list(direct.outputs[0].token_ids) == tokens
