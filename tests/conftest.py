from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from vllm.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from vllm.model_executor.model_loader import resolve_model

    return AutoModelForCausalLM.from_pretrained(
        resolve_model("SmolLM2-135M-Instruct"), dtype=torch.float32
    ).eval()


def hf_greedy(hf_model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = hf_model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return out[0, ids.shape[1] :].tolist()
