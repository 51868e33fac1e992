"""Qwen3-VL images through the engine (the tiny random model of
tests/model_executor/test_qwen3_vl.py, prompts as token ids): each image sized by the
model's processor into a grid of 16-pixel patches, its placeholder expanded to the grid's
tokens, the interleaved M-RoPE positions and the deepstack features carried through prefill
chunks that cut the images. The greedy tokens and their logprobs equal transformers'
``generate`` on the same pixels, whole, in chunks of 5, from the prefix cache, and beside
a request with other images in the same steps."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.model_executor.test_qwen3_vl import make_hf, save

# Qwen2-VL's reference: the same prompt expansion and generate call.
from tests.multimodal.test_qwen2_vl_engine import GREEDY, PROMPT, image, reference
from vllm import LLM


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("qwen3_vl"))


def build_model(path, make=make_hf):
    """(folder, transformers model, its image processor): ``make()``'s model (the dense
    one, or Qwen3-VL-MoE's), the merger's output scaled up so that the images move the
    logprobs."""
    hf = make()
    with torch.no_grad():
        hf.model.visual.merger.linear_fc2.weight.mul_(20)
    save(hf, path)
    processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    return path, hf, processor


def test_images_with_deepstack_equal_transformers(model):
    images = [image(0, (70, 50)), image(1, (64, 128))]  # grids of 4 x 4 and 4 x 8 patches
    other = [image(2, (70, 50)), image(3, (64, 128))]
    ids, tokens, logprobs = reference(model, images)
    _, other_tokens, other_logprobs = reference(model, other)
    assert len(ids) == len(PROMPT) - 2 + 4 + 8
    assert max(abs(a - b) for a, b in zip(logprobs, other_logprobs, strict=True)) > 1e-3
    for chunk in (128, 5):  # 5: images, positions and deepstack rows cut across chunks
        llm = LLM(model=str(model[0]), skip_tokenizer_init=True, max_model_len=128,
                  max_num_batched_tokens=chunk, block_size=4)  # fmt: skip
        try:
            request = {"prompt_token_ids": PROMPT, "multi_modal_data": {"image": images}}
            changed = {**request, "multi_modal_data": {"image": other}}
            first = llm.generate(request, GREEDY)
            again, beside = llm.generate([request, changed], GREEDY)  # one batch
        finally:
            llm.shutdown()
        assert first[0].prompt_token_ids == ids
        assert again.num_cached_tokens >= len(ids) - 4
        for got, want_tokens, want_logprobs in (
            (first[0], tokens, logprobs),
            (again, tokens, logprobs),
            (beside, other_tokens, other_logprobs),
        ):
            out = got.outputs[0]
            assert list(out.token_ids) == want_tokens
            got_logprobs = [lp.logprob for lp in out.logprobs]
            assert max(abs(a - b) for a, b in zip(got_logprobs, want_logprobs, strict=True)) < 1e-4
