"""DeepSeek's MTP layer as the draft on CUDA with CUDA graphs: a bf16 engine over
tests/v1/spec_decode/test_mtp.py's tiny DeepSeek-V3 with an MTP layer, both on
``TRITON_MLA``. The target's decode steps and the MTP layer's single-token steps (its
hidden-state input a graph buffer) replay graphs, counted; every token is within a bf16
near-tie of the target's teacher-forced argmax (``test_draft_model_cuda.py``'s check);
some drafts are kept.

Run with ``pytest -m cuda tests/cuda/test_mtp_cuda.py`` on a CUDA machine with triton;
skipped without one. On the CPU: tests/v1/spec_decode/test_mtp.py (exact proposals
against a reference, stand-in graphs over the emulated MLA kernels).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.cuda.test_draft_model_cuda import TIE, teacher_forced_margins
from tests.v1.spec_decode.test_draft_model import counting
from tests.v1.spec_decode.test_mtp import PROMPTS, save_target_with_mtp
from vllm.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


def test_greedy_bf16_with_mtp_graphs_is_plain_decoding(tmp_path):
    from vllm import LLM

    save_target_with_mtp(tmp_path)
    kwargs = dict(model=str(tmp_path), dtype="bfloat16", max_model_len=128, max_num_seqs=8,
                  kv_cache_memory="256MiB", skip_tokenizer_init=True)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(**kwargs)
    try:
        spec = LLM(**kwargs, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        try:
            runner = spec.engine_core.model_runner
            assert runner.drafter.attn_backend.name == "TRITON_MLA"
            assert runner.decode_graphs is not None and runner.drafter.graphs is not None
            with counting(spec) as counts:
                got = [list(o.outputs[0].token_ids) for o in spec.generate(prompts, params)]
            target_replays = runner.decode_graphs.num_replays
            head_replays = runner.drafter.graphs.num_replays
            spec.engine_core.scheduler.check_invariants()
        finally:
            spec.shutdown()
        margins = teacher_forced_margins(plain, PROMPTS, got)
    finally:
        plain.shutdown()
    assert all(len(o) == 48 for o in got)
    worst = max(max(m) for m in margins)
    assert worst <= TIE, (worst, margins)
    assert counts["accepted"] > 0, counts
    assert head_replays >= 20 and target_replays >= 1, (target_replays, head_replays)
