"""EAGLE speculative decoding on CUDA with CUDA graphs: a bf16 engine over a tiny random
Llama and EAGLE-1 / EAGLE-3 heads built from its own weights (tests/eagle_checkpoints.py).
The target's decode steps (an EAGLE-3 target's keeping its auxiliary hidden states in a
buffer of the graphs) and the head's single-token steps (its hidden-state input a buffer)
replay graphs, counted; every token is within a bf16 near-tie of the target's
teacher-forced argmax (``test_draft_model_cuda.py``'s check); a good share of the drafts
are kept (the heads agree with their target about a third of the time in fp32).

Run with ``pytest -m cuda tests/cuda/test_eagle_cuda.py`` on a CUDA machine with triton;
skipped without one. On the CPU: tests/v1/spec_decode/test_eagle.py (exact proposals
against a reference, stand-in graphs).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.cuda.test_draft_model_cuda import TIE, teacher_forced_margins
from tests.eagle_checkpoints import save_eagle, save_tiny_target
from tests.v1.spec_decode.test_draft_model import counting
from vllm.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]

PROMPTS = [[5 + (7 * i) % 200 for i in range(40)], [11, 12, 13, 14] * 6, list(range(100, 117))]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_bf16_with_head_graphs_is_plain_decoding(tmp_path, method):
    from vllm import LLM

    save_tiny_target(tmp_path / "target")
    save_eagle(tmp_path / "head", tmp_path / "target", method, noise=0.3)
    kwargs = dict(model=str(tmp_path / "target"), dtype="bfloat16", max_model_len=256,
                  max_num_seqs=16, kv_cache_memory="256MiB", skip_tokenizer_init=True)  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(**kwargs)
    try:
        head = {"method": method, "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
        spec = LLM(**kwargs, speculative_config=head)
        try:
            runner = spec.engine_core.model_runner
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
    assert counts["accepted"] >= 0.15 * counts["draft_tokens"] > 0, counts
    assert target_replays >= 8 and head_replays >= 2 * target_replays, (
        target_replays,
        head_replays,
    )
