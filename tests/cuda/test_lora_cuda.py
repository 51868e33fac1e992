"""LoRA on CUDA (``vllm/lora``): a tiny Llama in fp32 with decode steps replayed from CUDA
graphs that compute every adapter slot; requests with two adapters and the base model,
batched together, give transformers' greedy tokens with each adapter merged. The CPU
tests are tests/lora/.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from tests.lora.test_lora import greedy_reference, save_base, write_adapter
from vllm.lora.request import LoRARequest

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "enforce_eager, async_scheduling",
    [(False, False), (True, False), (False, True)],
    ids=["graphs", "eager", "async"],  # async: each step's slots set while the last runs
)
def test_adapters_batched_on_cuda_give_the_merged_models_tokens(
    tmp_path, enforce_eager, async_scheduling
):
    from vllm import LLM, SamplingParams

    hf = save_base(tmp_path / "base")
    a = write_adapter(tmp_path / "a", seed=1)
    b = write_adapter(tmp_path / "b", seed=2, targets=("q_proj", "v_proj", "down_proj"))
    loras = [LoRARequest("a", 1, str(a)), None, LoRARequest("b", 2, str(b))]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (11, 30, 7)]
    expected = greedy_reference(hf, prompts, loras, 12)
    llm = LLM(model=str(tmp_path / "base"), dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, max_num_seqs=4, enforce_eager=enforce_eager,
              async_scheduling=async_scheduling)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
