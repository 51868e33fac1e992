"""Images through the engine (``LLM.generate`` with ``multi_modal_data``) on a tiny random
LLaVA: the greedy tokens equal transformers' ``generate`` on the same pixels, whole or with
an image cut across prefill chunks, two images in a prompt, after a prefix-cache hit and
after preemption; the prefix cache shares an image's blocks only with the same image; bad
image inputs are refused, naming ``multi_modal_data``, and the engine serves on."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.model_executor.test_llava import make_hf, save
from tests.utils import copy_benchmark_tokenizer
from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError

IMAGE = 16  # SmolLM2's "<empty_output>": one special token, the tiny LLaVA's image token
TOKENS_PER_IMAGE = 4  # 28-pixel images in 14-pixel patches
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("tiny-llava"))


def build_llava(path):
    """(folder, transformers model): the tiny LLaVA with SmolLM2's vocabulary, its
    projector scaled up so that the image decides the greedy tokens."""
    hf = make_hf(text={"vocab_size": 49152}, image_token_index=IMAGE)
    with torch.no_grad():
        hf.model.multi_modal_projector.linear_2.weight.mul_(20)
    save(hf, path)
    copy_benchmark_tokenizer(path, chat_template=True)
    return path, hf


def image(seed: int, size=(40, 50)) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (*size, 3), dtype=np.uint8))


def expanded(prompt: list[int]) -> list[int]:
    return [t for p in prompt for t in ([IMAGE] * TOKENS_PER_IMAGE if p == IMAGE else [p])]


def hf_greedy(llava, prompt: list[int], images: list[Image.Image]) -> list[int]:
    path, hf = llava
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    ids = torch.tensor([expanded(prompt)])
    out = hf.generate(input_ids=ids, pixel_values=pixels, max_new_tokens=6, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def run(llm: LLM, prompt: list[int], images) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from the prefix cache)."""
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    return list(out[0].outputs[0].token_ids), out[0].num_cached_tokens


PROMPT = [50, 60, 70, 80, 90, IMAGE, 100, 110, 120]  # the image at positions 5..8


def test_greedy_tokens_equal_transformers_whole_and_in_chunks(llava):
    two = [50, IMAGE, 60, 70, IMAGE, 80]
    for chunk in (64, 3):  # 3: each image's four rows fall in two chunks
        llm = LLM(model=str(llava[0]), max_model_len=64, max_num_batched_tokens=chunk,
                  enable_prefix_caching=False)  # fmt: skip
        try:
            cat, dog = (run(llm, PROMPT, image(s))[0] for s in (0, 1))
            both = run(llm, two, [image(1), image(0)])[0]
        finally:
            llm.shutdown()
        assert cat == hf_greedy(llava, PROMPT, [image(0)])
        assert dog == hf_greedy(llava, PROMPT, [image(1)])
        assert cat != dog  # the image decides them
        assert both == hf_greedy(llava, two, [image(1), image(0)])


def test_prefix_cache_shares_an_image_only_with_itself(llava):
    llm = LLM(model=str(llava[0]), max_model_len=64, block_size=4, enable_prefix_caching=True)
    try:
        first, _ = run(llm, PROMPT, image(0))
        again, cached_again = run(llm, PROMPT, image(0))
        other, cached_other = run(llm, PROMPT, image(1))
        # The same pixels from another image object (a copy) are the same image.
        copy, cached_copy = run(llm, PROMPT, image(0).copy())
    finally:
        llm.shutdown()
    assert first == again == copy == hf_greedy(llava, PROMPT, [image(0)])
    assert cached_again == cached_copy == 8  # 12 prompt tokens: two of its full blocks
    assert cached_other == 4  # the block before the image only
    assert other == hf_greedy(llava, PROMPT, [image(1)])


def test_an_image_sent_again_is_not_encoded_again(llava):
    # The second request's prefix-cache hit (8 of its 12 prompt tokens) ends inside the
    # image (positions 5..8): its rows come from the encoder cache, not the encoder.
    llm = LLM(model=str(llava[0]), max_model_len=64, block_size=4)
    runner = llm.engine_core.model_runner
    encoded = []
    embed = runner.model.embed_images
    runner.model.embed_images = lambda pixels: encoded.append(len(pixels)) or embed(pixels)
    try:
        first, _ = run(llm, PROMPT, image(0))
        again, cached = run(llm, PROMPT, image(0))
        assert cached == 8 and encoded == [1] and runner.encoder_cache.hits == 1
        runner.encoder_cache.clear()  # then it is encoded again, to the same tokens
        assert run(llm, PROMPT, image(0))[0] == first == again
        assert encoded == [1, 1]
    finally:
        llm.shutdown()
    assert first == hf_greedy(llava, PROMPT, [image(0)])


def test_the_encoder_budget_spreads_images_over_steps_and_encodes_one_image_once(llava):
    # Budget 7: the first request's 5 tokens encode its image (4 embeddings); the second's
    # chunk would reach its own (4 + 4 > 7), so it stops before it, and the encoder runs
    # one image a step. The same image in two requests of one step is encoded once.
    first, second = [IMAGE, 50], [60, IMAGE, 70]
    for budget, images, want in ((7, [image(0), image(1)], [1, 1]), (64, [image(0)] * 2, [1])):
        llm = LLM(model=str(llava[0]), max_model_len=64, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)  # fmt: skip
        runner = llm.engine_core.model_runner
        encoded = []
        runner.model.embed_images = partial(_counted, encoded, runner.model.embed_images)
        try:
            outs = llm.generate(
                [{"prompt_token_ids": p, "multi_modal_data": {"image": img}}
                 for p, img in zip((first, second), images, strict=True)],
                GREEDY,
            )  # fmt: skip
        finally:
            llm.shutdown()
        assert encoded == want
        for p, img, out in zip((first, second), images, outs, strict=True):
            assert list(out.outputs[0].token_ids) == hf_greedy(llava, p, [img])


def _counted(encoded: list[int], embed, pixels):
    encoded.append(len(pixels))
    return embed(pixels)


def test_preempted_requests_compute_their_images_again(llava):
    # 11 usable blocks of 4 for four requests of 12 + 6 tokens (5 blocks each): they
    # preempt each other, and each resumes by computing its prompt, image included.
    llm = LLM(model=str(llava[0]), max_model_len=64, block_size=4, num_gpu_blocks_override=12,
              enable_prefix_caching=False)  # fmt: skip
    preemptions = []
    step = llm.engine_core.step

    def counting_step():
        outputs = step()
        preemptions.append(outputs.scheduler_stats.num_preemptions)
        return outputs

    llm.engine_core.step = counting_step
    try:
        prompts = [
            {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": image(s)}} for s in range(4)
        ]
        outs = llm.generate(prompts, GREEDY)
    finally:
        llm.shutdown()
    assert sum(preemptions) > 0
    for s, out in enumerate(outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(llava, PROMPT, [image(s)])


def test_bad_image_inputs_are_refused_and_the_engine_serves_on(llava, tmp_path):
    llm = LLM(model=str(llava[0]), max_model_len=64, limit_mm_per_prompt={"image": 2})
    try:
        cases = [
            (
                {"image": [image(0), image(1)]},
                PROMPT,
                "2 images need 2 image placeholder tokens .* it holds 1",
            ),
            ({"image": [image(0)] * 3}, [IMAGE] * 3, "at most 2 images"),
            ({"image": "cat.png"}, PROMPT, r"multi_modal_data\['image'\]\[0\] must be a PIL"),
            ({"video": [image(0)]}, PROMPT, "modality 'video' is not supported"),
            ([image(0)], PROMPT, "multi_modal_data must be a dict"),
        ]
        for data, prompt, message in cases:
            with pytest.raises(VLLMValidationError, match=message) as e:
                llm.generate({"prompt_token_ids": prompt, "multi_modal_data": data}, GREEDY)
            assert e.value.param == "multi_modal_data"
        assert run(llm, PROMPT, image(0))[0] == hf_greedy(llava, PROMPT, [image(0)])
    finally:
        llm.shutdown()
    from tests.tiny_models import save_tiny_llama

    save_tiny_llama(tmp_path)
    copy_benchmark_tokenizer(tmp_path)
    text = LLM(model=str(tmp_path), max_model_len=64)
    try:
        with pytest.raises(VLLMValidationError, match="takes no images"):
            text.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": image(0)}})
        assert text.generate({"prompt_token_ids": [5, 6]}, GREEDY)[0].outputs[0].token_ids
    finally:
        text.shutdown()


def test_an_image_the_encoder_fails_on_fails_its_request_only(llava):
    """Three requests in one step, one image each: the encoder raises whenever the batch
    holds the bad image (its pixels' sum marks it), so the step's one pass fails, each
    image is encoded alone, and only the bad image's request fails (finish reason
    "error"); the others get transformers' tokens, nothing is left in the pool, and the
    engine serves on."""
    llm = LLM(model=str(llava[0]), max_model_len=64, block_size=4, num_gpu_blocks_override=32)
    runner = llm.engine_core.model_runner
    embed = runner.model.embed_images
    processor = transformers.AutoImageProcessor.from_pretrained(llava[0], backend="pil")
    bad_sum = processor(images=[image(1)], return_tensors="pt")["pixel_values"].sum()
    passes = []

    def faulty(pixels):
        passes.append(len(pixels))
        if any(torch.isclose(p.sum().cpu(), bad_sum) for p in pixels):
            raise RuntimeError("out of memory (injected)")
        return embed(pixels)

    runner.model.embed_images = faulty
    try:
        requests = [{"prompt_token_ids": PROMPT, "multi_modal_data": {"image": image(s)}}
                    for s in range(3)]  # fmt: skip
        outs = llm.generate(requests, GREEDY)
        assert passes == [3, 1, 1, 1]  # together, then each alone
        reasons = [o.outputs[0].finish_reason for o in outs]
        assert reasons == ["length", "error", "length"]
        assert outs[1].outputs[0].token_ids == []
        for s in (0, 2):
            assert list(outs[s].outputs[0].token_ids) == hf_greedy(llava, PROMPT, [image(s)])
        core = llm.engine_core
        core.scheduler.check_invariants()
        assert core.scheduler.kv_cache_manager.usage == 0.0
        # The next step delivers the failed request's end: the runner forgets it.
        assert run(llm, PROMPT, image(2))[0] == hf_greedy(llava, PROMPT, [image(2)])
        assert outs[1].request_id not in runner.requests
    finally:
        llm.shutdown()
