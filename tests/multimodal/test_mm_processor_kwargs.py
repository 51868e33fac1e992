"""``--mm-processor-kwargs`` and a request's ``mm_processor_kwargs`` (vLLM's): the image
processor's arguments. On the tiny Qwen2-VL (tests/model_executor/test_qwen2_vl.py, its
processor allowing 16 merged patches of 28 x 28 pixels) a lower ``max_pixels`` gives an
image fewer tokens, and the tokens transformers gives for those pixels, set for the
server or for one request alike; what a processor does not take, what fixes the model's
own sizes and a size above the server's are refused naming ``mm_processor_kwargs``, as
is a LLaVA crop its tower cannot take."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.multimodal.test_llava_engine import build_llava
from tests.multimodal.test_qwen2_vl_engine import GREEDY, PROMPT, build_model, image, reference
from vllm import LLM

SMALL = {"max_pixels": 28 * 28 * 4}  # the tiny processor's own: 28 * 28 * 16
IMAGES = [image(0, (70, 50)), image(1, (112, 224))]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return build_model("Qwen2VL", tmp_path_factory.mktemp("qwen2vl"))


def generate(llm: LLM, **fields):
    request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": IMAGES}, **fields}
    return llm.generate(request, GREEDY)[0]


def test_a_lower_max_pixels_gives_fewer_image_tokens_for_the_server_or_one_request(qwen):
    path, hf, processor = qwen
    ids, tokens, logprobs = reference((path, hf, functools.partial(processor, **SMALL)), IMAGES)
    full_ids, *_ = reference(qwen, IMAGES)
    assert len(ids) < len(full_ids)
    served = LLM(model=str(path), skip_tokenizer_init=True, max_model_len=128,
                 mm_processor_kwargs=SMALL)  # fmt: skip
    try:
        out = generate(served)
        # A request's own argument goes over the server's: its own max_pixels back.
        assert generate(served, mm_processor_kwargs={"max_pixels": 28 * 28}).prompt_token_ids != ids
    finally:
        served.shutdown()
    plain = LLM(model=str(path), skip_tokenizer_init=True, max_model_len=128)
    try:
        asked = generate(plain, mm_processor_kwargs=SMALL)
        default = generate(plain)
        for fields, match in (
            ({"foo": 1}, "'foo' is not an argument of this model's image processor"),
            ({"patch_size": 7}, "'patch_size' cannot be set"),
            ({"max_pixels": 28 * 28 * 64}, "larger than the server's"),
            ({"size": {"longest_edge": 28 * 28 * 4, "height": 28}}, "larger than the server's"),
            ({"do_resize": False}, "could not be processed"),
            ("big", "must be an object"),
        ):
            with pytest.raises(ValueError, match=match) as e:
                generate(plain, mm_processor_kwargs=fields)
            assert e.value.param in ("mm_processor_kwargs", "multi_modal_data")
        assert generate(plain).prompt_token_ids == default.prompt_token_ids  # nothing stuck
    finally:
        plain.shutdown()
    assert default.prompt_token_ids == full_ids
    for got in (out, asked):
        assert got.prompt_token_ids == ids
        assert list(got.outputs[0].token_ids) == tokens
        got_logprobs = [lp.logprob for lp in got.outputs[0].logprobs]
        np.testing.assert_allclose(got_logprobs, logprobs, atol=1e-4, rtol=0)


def test_the_servers_arguments_are_checked_at_start(qwen):
    with pytest.raises(ValueError, match="'foo' is not an argument") as e:
        LLM(model=str(qwen[0]), skip_tokenizer_init=True, mm_processor_kwargs={"foo": 1})
    assert e.value.param == "mm_processor_kwargs"


def test_a_crop_the_tower_cannot_take_is_refused(tmp_path):
    path, _ = build_llava(tmp_path)
    llm = LLM(model=str(path), max_model_len=128)
    try:
        request = {"prompt": "<empty_output> hi", "multi_modal_data": {"image": IMAGES[0]}}
        crop = {"crop_size": {"height": 14, "width": 14}}
        with pytest.raises(ValueError, match=r"made images of \(14, 14\) pixels") as e:
            llm.generate({**request, "mm_processor_kwargs": crop}, GREEDY)
        assert e.value.param == "mm_processor_kwargs"
        plain = llm.generate(request, GREEDY)[0].outputs[0].token_ids
        raw = llm.generate({**request, "mm_processor_kwargs": {"do_normalize": False}}, GREEDY)
        assert raw[0].outputs[0].token_ids != plain  # other pixels, another answer
    finally:
        llm.shutdown()
