"""The hybrid KV cache on CUDA (docs/design.md, "KV cache"): bf16 engines on a tiny
gpt-oss (sinks, every other layer over a window) and a tiny Gemma 3 (seven sliding
groups of one layer over one tensor), their decode steps replayed from CUDA graphs over
a block table per group, in a pool small enough that the sliding groups' freed blocks
are taken by other requests. Each generated token is checked against the same model
keeping every block (``--disable-hybrid-kv-cache-manager``), teacher-forced: the argmax
at its position, or within a bf16 near-tie of it. A layer reading another group's
block, or a freed block another request rewrote, gives tokens far from it.

Run with ``pytest -m cuda tests/cuda/test_hybrid_kv_cuda.py`` on a CUDA machine; the
same paths run on the CPU in tests/v1/worker/test_kv_cache_groups.py (stand-in graphs).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.cuda.test_draft_model_cuda import TIE, teacher_forced_margins
from tests.utils import copy_benchmark_tokenizer
from vllm.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]
WINDOW = 24


def save_family(family: str, path) -> tuple:
    """The checkpoint and the KV cache groups' windows the engine should plan."""
    if family == "gpt-oss":
        from tests.model_executor.test_gpt_oss import hf_model

        hf = hf_model(vocab_size=49152, sliding_window=WINDOW, max_position_embeddings=1024)
        hf.save_pretrained(path)
        return (None, WINDOW)
    from tests.model_executor.test_gemma import save_checkpoint

    layer_types = ["full_attention" if i == 5 else "sliding_attention" for i in range(8)]
    save_checkpoint(
        "Gemma3ForCausalLM", path, vocab_size=49152, num_hidden_layers=8,
        layer_types=layer_types, sliding_window=WINDOW, max_position_embeddings=1024,
    )  # fmt: skip
    return (None,) + (WINDOW,) * 7


# KV bytes (bf16: 2 KiB a block for both): less than the four requests' blocks, so that
# requests wait for each other and take each other's freed blocks.
KV_MEMORY = {"gpt-oss": "150KiB", "gemma3": "450KiB"}


@pytest.mark.parametrize("family", ["gpt-oss", "gemma3"])
def test_hybrid_bf16_with_graphs_keeps_every_blocks_tokens(family, tmp_path):
    from vllm import LLM

    windows = save_family(family, tmp_path)
    copy_benchmark_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (300, 120, 450, 60)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = dict(model=str(tmp_path), dtype="bfloat16", max_model_len=512, max_num_seqs=8,
                  max_num_batched_tokens=256)  # fmt: skip
    hybrid = LLM(**kwargs, kv_cache_memory=KV_MEMORY[family])
    try:
        runner = hybrid.engine_core.model_runner
        assert runner.kv_cache_windows == windows and runner.decode_graphs is not None
        got = [list(o.outputs[0].token_ids) for o in hybrid.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]  # fmt: skip
        replays = runner.decode_graphs.num_replays
        hybrid.engine_core.scheduler.check_invariants()
    finally:
        hybrid.shutdown()
    every = LLM(**kwargs, kv_cache_memory="64MiB", disable_hybrid_kv_cache_manager=True)
    try:
        assert every.engine_core.model_runner.kv_cache_windows == (None,)
        margins = teacher_forced_margins(every, prompts, got)
    finally:
        every.shutdown()
    assert all(len(o) == 40 for o in got)
    worst = max(max(m) for m in margins)
    assert worst <= TIE, (worst, margins)
    assert replays >= 30, replays
