"""N-gram speculative decoding on CUDA: a random tiny Llama (normal init, fp32, SmolLM2's
vocabulary and tokenizer) gives the same greedy tokens with and without drafts, and takes
drafts. The CPU engine test is tests/v1/spec_decode/test_ngram.py.

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


def test_greedy_tokens_equal_plain_decoding_on_cuda(tmp_path):
    from vllm import LLM, SamplingParams

    save_smollm_vocab_llama(tmp_path)
    pattern = [300 + t for t in range(12)]
    prompts = [pattern * 4, pattern[::-1] * 3 + pattern, [7, 8, 9] * 20]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    kwargs = dict(model=str(tmp_path), dtype="float32", max_model_len=512, max_num_seqs=4)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    outputs = {}
    for name, extra in (("plain", {}), ("ngram", {"speculative_config": spec})):
        llm = LLM(**kwargs, **extra)
        drafts = []
        step = llm.engine_core.step

        def counting(step=step, drafts=drafts):
            out = step()
            stats = out.scheduler_stats
            if stats is not None and stats.spec_decoding_stats is not None:
                drafts.append(stats.spec_decoding_stats.num_draft_tokens)
            return out

        llm.engine_core.step = counting
        try:
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            outputs[name] = ([o.outputs[0].token_ids for o in got], sum(drafts))
            llm.engine_core.scheduler.check_invariants()
        finally:
            llm.shutdown()
    assert outputs["ngram"][0] == outputs["plain"][0]
    assert outputs["ngram"][1] > 0  # drafts were proposed and checked
