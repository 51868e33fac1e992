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
