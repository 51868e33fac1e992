"""Gemma 3's images through the engine on a tiny random model: the prompt framed as
transformers' ``Gemma3Processor`` frames it (tests/multimodal/test_gemma3_processing.py's
tokenizer), the SigLIP tower and projector (tests/model_executor/test_gemma3_mm.py's
shapes), and each image's tokens attending to each other both ways, past a 12-token
sliding window. The engine gives transformers' greedy tokens and logprobs with
``token_type_ids`` (its bidirectional image mask; each token from a whole forward, see
``reference``), whole, in prefill chunks that must stop before each image, from a prefix
hit that ends inside an image, and through ``LLM.chat``; causal attention over the images
gives other logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tests.model_executor.test_gemma3_mm import TEXT, VISION
from tests.multimodal.test_gemma3_processing import BOI, EOI, SOFT, save_tokenizer
from tests.multimodal.utils import check_greedy, image_parts
from vllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
TOKENS_PER_IMAGE = 16
PROMPT = f"user\nx look at {BOI} and {BOI}\nx"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("gemma3"))


def build_model(path):
    """(folder, transformers model, transformers' processor)."""
    tokenizer = save_tokenizer(path)
    ids = tokenizer.convert_tokens_to_ids
    config = transformers.Gemma3Config(
        text_config={**TEXT, "vocab_size": len(tokenizer)}, vision_config=VISION,
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=ids(BOI),
        eoi_token_index=ids(EOI), image_token_index=ids(SOFT),
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") and "vision_tower" not in name:
                p.uniform_(-0.5, 0.5)  # Gemma's norms: offsets from a scale of 1
            elif name.endswith("mm_input_projection_weight"):
                p.normal_(0.0, 2.0)  # zeros at init: drawn, large, so images move logits
    hf.save_pretrained(path)
    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    image_processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    processor = transformers.Gemma3Processor(
        image_processor, tokenizer, image_seq_length=TOKENS_PER_IMAGE
    )
    return path, hf, processor


def image(seed: int, size=(40, 30)) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray(rng.randint(0, 255, (*size, 3), dtype=np.uint8))


def reference(model, images, prompt=PROMPT, both_ways=True, max_tokens=6):
    """(transformers' prompt ids, its greedy tokens, their logprobs); ``both_ways``: with
    ``token_type_ids`` (each image's tokens attend both ways), else causal. Each token
    from a whole forward over the prompt and the tokens so far: transformers' ``generate``
    (a cache, a sliding window) gives other logprobs than its own whole forward once a
    prompt's text runs past the window after the images (measured: 0.05 at the second
    token of the chat test's prompt), and the engine's equal the whole forward's."""
    _, hf, processor = model
    out = processor(text=prompt, images=images, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    seq, types = out["input_ids"], out["token_type_ids"]
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        extra = {"token_type_ids": types} if both_ways else {}
        with torch.inference_mode():
            logits = hf(input_ids=seq, pixel_values=out["pixel_values"], **extra).logits
        row = torch.log_softmax(logits[0, -1].float(), -1)
        token = int(row.argmax())
        tokens.append(token)
        logprobs.append(row[token].item())
        seq = torch.cat([seq, torch.tensor([[token]])], 1)
        types = torch.cat([types, torch.zeros(1, 1, dtype=types.dtype)], 1)
    return ids, tokens, logprobs


def test_images_attend_both_ways_as_transformers(model):
    images = [image(0), image(1, (20, 50))]
    ids, tokens, logprobs = reference(model, images)
    _, _, causal = reference(model, images, both_ways=False)
    assert max(abs(a - b) for a, b in zip(logprobs, causal, strict=True)) > 1e-3
    # Another prompt, sharing the first image and the text up to inside the second (its
    # last block differs after it): its prefix hit ends inside that image.
    other_prompt = PROMPT.removesuffix("\nx") + " look"
    other_ids, other_tokens, other_logprobs = reference(model, images, other_prompt)
    soft = ids.count(ids[ids.index(model[2].tokenizer.convert_tokens_to_ids(SOFT))])
    assert soft == 2 * TOKENS_PER_IMAGE
    for chunk in (128, 20):  # 20: the chunk before each image stops at it
        llm = LLM(model=str(model[0]), max_model_len=128, max_num_batched_tokens=chunk,
                  block_size=4, enable_prefix_caching=True)  # fmt: skip
        try:
            first = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": images}}, GREEDY)
            other = llm.generate(
                {"prompt": other_prompt, "multi_modal_data": {"image": images}}, GREEDY
            )
        finally:
            llm.shutdown()
        assert first[0].prompt_token_ids == ids
        assert other[0].prompt_token_ids == other_ids
        second_image_end = len(ids) - 3  # <end_of_image>, "\n\n\n", "x" follow it
        hit = other[0].num_cached_tokens
        assert second_image_end - TOKENS_PER_IMAGE < hit < second_image_end
        for got, want_tokens, want_logprobs in (
            (first, tokens, logprobs),
            (other, other_tokens, other_logprobs),
        ):
            check_greedy(got, want_tokens, want_logprobs)


def test_a_budget_shorter_than_an_image_is_refused_at_start(model):
    """Unless the server takes no images (the checkpoint served as text)."""
    with pytest.raises(ValueError, match="--max-num-batched-tokens 8 is shorter than one image"):
        LLM(model=str(model[0]), max_model_len=128, max_num_batched_tokens=8)
    llm = LLM(model=str(model[0]), max_model_len=128, max_num_batched_tokens=8,
              limit_mm_per_prompt={"image": 0})  # fmt: skip
    try:
        out = llm.generate({"prompt": "user\nx look"}, GREEDY)[0].outputs[0]
        assert len(out.token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()


# Gemma 3's chat template in small: typed parts, an image written as <start_of_image>.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\\n' }}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<start_of_image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def test_chat_image_parts_are_framed_as_transformers_frames_them(model):
    """LLM.chat with image_url parts under a Gemma-style template: the prompt ids
    transformers' processor makes of the rendered text (its "\\n" before the first image
    joined with the frame's "\\n\\n"), and transformers' greedy tokens."""
    images = [image(0), image(1, (20, 50))]
    messages = [{"role": "user", "content": image_parts(images, "look")}]
    llm = LLM(model=str(model[0]), max_model_len=128)
    try:
        chat = llm.chat(messages, GREEDY, chat_template=CHAT_TEMPLATE)[0]
    finally:
        llm.shutdown()
    assert chat.prompt.startswith(f"<start_of_turn>user\n{BOI}{BOI}look<end_of_turn>")
    ids, tokens, logprobs = reference(model, images, chat.prompt)
    assert chat.prompt_token_ids == ids
    check_greedy([chat], tokens, logprobs)
