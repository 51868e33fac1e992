"""Custom logits processors (--logits-processors) on CUDA: a random tiny Llama (bf16,
SmolLM2's vocabulary) through CUDA graphs and chunked prefill, with and without
--async-scheduling; the processors get CUDA logits and the forced tokens come out. The CPU
tests are tests/v1/sample/test_logits_processors.py.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from tests.utils import save_smollm_vocab_llama

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HERE = "tests.v1.sample.test_logits_processors"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_processors_force_their_tokens_on_cuda(tmp_path, async_scheduling):
    from vllm import LLM, SamplingParams

    save_smollm_vocab_llama(tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (8 + 21 * i,), generator=gen).tolist() for i in range(6)]
    llm = LLM(
        model=str(tmp_path),
        dtype="bfloat16",
        max_model_len=512,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
        logits_processors=[f"{HERE}:TargetTokenProcessor", f"{HERE}:NoRepeatProcessor"],
    )
    try:
        params = []
        for i in range(6):
            extra = {"target_token": 500 + i} if i % 3 == 0 else {"no_repeat": True}
            extra = None if i % 3 == 2 else extra
            params.append(SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                         extra_args=extra))  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        for i, out in enumerate(outs):
            tokens = list(out.outputs[0].token_ids)
            assert len(tokens) == 12
            if i % 3 == 0:
                assert tokens == [500 + i] * 12
            elif i % 3 == 1:
                assert len(set(tokens)) == 12
    finally:
        llm.shutdown()
