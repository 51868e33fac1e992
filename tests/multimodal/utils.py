"""What the image engine tests share: transformers' greedy reference."""

from __future__ import annotations

import numpy as np
import torch


def hf_greedy(hf, input_ids: list[int], max_new_tokens: int = 6, **inputs):
    """transformers' ``generate`` after ``input_ids`` (one prompt; ``inputs``: its pixel
    values and the like): its greedy tokens, and their logprobs (a tiny random model's
    distribution is nearly flat, so the logprobs, not the tokens, show that the images
    were read, and read right)."""
    gen = hf.generate(
        input_ids=torch.tensor([input_ids]), max_new_tokens=max_new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True, **inputs,
    )  # fmt: skip
    tokens = gen.sequences[0, len(input_ids) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item()
        for step, t in zip(gen.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def check_greedy(outputs, tokens: list[int], logprobs: list[float]) -> None:
    """The engine's first output (``LLM.generate``'s, with ``logprobs=0``) has ``tokens``,
    and their logprobs within 1e-4 of ``logprobs``."""
    out = outputs[0].outputs[0]
    assert list(out.token_ids) == tokens
    np.testing.assert_allclose([lp.logprob for lp in out.logprobs], logprobs, atol=1e-4, rtol=0)


def check_engine_images(path, request: dict, other_images, ids, want, other_want, **llm_kwargs):
    """The engine on ``request`` (a prompt dict with its ``multi_modal_data`` images), whole
    and in prefill chunks of 5 (markers and images cut across chunks): its prompt ids are
    ``ids`` and its greedy tokens and logprobs ``want`` (tokens, logprobs, as
    ``hf_greedy`` gives them), again from the prefix cache (all its full blocks), and with
    ``other_images`` instead, which change the logprobs, ``other_want``."""
    from vllm import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    assert max(abs(a - b) for a, b in zip(want[1], other_want[1], strict=True)) > 1e-3
    changed_request = {**request, "multi_modal_data": {"image": other_images}}
    for chunk in (128, 5):
        llm = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=chunk,
                  block_size=4, enable_prefix_caching=True, **llm_kwargs)  # fmt: skip
        try:
            first, again = llm.generate(request, greedy), llm.generate(request, greedy)
            changed = llm.generate(changed_request, greedy)
        finally:
            llm.shutdown()
        assert first[0].prompt_token_ids == ids
        assert again[0].num_cached_tokens >= len(ids) - 4
        for got, expected in ((first, want), (again, want), (changed, other_want)):
            check_greedy(got, *expected)


def image_parts(images, text: str) -> list[dict]:
    """A chat message's content: each image as an ``image_url`` part (a PNG data URL), then
    ``text``."""
    import base64
    import io

    parts = []
    for img in images:
        buffer = io.BytesIO()
        img.save(buffer, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return [*parts, {"type": "text", "text": text}]
