"""Images on CUDA: the tiny LLaVA, SmolVLM, Qwen2.5-VL, Qwen3-VL (dense and MoE), Mistral 3,
Gemma 3 and InternVL of tests/multimodal served on the GPU (M-RoPE steps with (3, T) positions
among them, Qwen3-VL's deepstack features added after its first layers, Mistral 3's
images of two sizes through the Pixtral tower, Gemma 3's image tokens attending both
ways: in bf16 FlashAttention's causal rows, then the image rows again). In fp32
(TORCH_SDPA: FlashAttention takes no fp32) the greedy tokens and their logprobs equal
transformers' on the CPU, chunked prefill cutting the images; in bf16 (FlashAttention,
decode steps from CUDA graphs) the logprobs stay within bf16's rounding of those.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model_executor import test_qwen3_vl_moe as moe
from tests.multimodal import test_gemma3_engine as framed
from tests.multimodal import test_idefics3_engine as tiled
from tests.multimodal import test_internvl_engine as framed_tiles
from tests.multimodal import test_llava_engine as whole
from tests.multimodal import test_mistral3_engine as rows
from tests.multimodal import test_qwen2_vl_engine as grid
from tests.multimodal import test_qwen3_vl_engine as deepstack
from vllm import LLM, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


def served(path, dtype: str, request: dict, **kw) -> tuple[list[int], list[float]]:
    kw = {"max_num_batched_tokens": 5, **kw}
    llm = LLM(model=str(path), dtype=dtype, max_model_len=128, block_size=16,
              enable_prefix_caching=True, **kw)  # fmt: skip
    try:
        out = llm.generate(request, GREEDY)[0].outputs[0]
    finally:
        llm.shutdown()
    return list(out.token_ids), [lp.logprob for lp in out.logprobs]


def check(path, request: dict, tokens: list[int], logprobs: list[float], **kw) -> None:
    got_tokens, got = served(path, "float32", request, **kw)
    assert got_tokens == tokens
    np.testing.assert_allclose(got, logprobs, atol=1e-4, rtol=0)
    _, got_bf16 = served(path, "bfloat16", request, **kw)
    np.testing.assert_allclose(got_bf16[:1], logprobs[:1], atol=5e-2, rtol=0)


def test_llava_on_cuda(tmp_path_factory):
    path, hf = whole.build_llava(tmp_path_factory.mktemp("llava"))
    img = whole.image(0)
    request = {"prompt_token_ids": whole.PROMPT, "multi_modal_data": {"image": img}}
    expected = whole.hf_greedy((path, hf), whole.PROMPT, [img])
    tokens, logprobs = served(path, "float32", request)
    assert tokens == expected
    _, bf16 = served(path, "bfloat16", request)
    np.testing.assert_allclose(bf16[:1], logprobs[:1], atol=5e-2, rtol=0)


def test_smolvlm_on_cuda(tmp_path_factory):
    model = tiled.build_model("smolvlm", tmp_path_factory.mktemp("smolvlm"))
    img = tiled.image(0)
    _, tokens, logprobs = tiled.reference(model, img)
    check(model[0], {"prompt": tiled.PROMPT, "multi_modal_data": {"image": img}}, tokens, logprobs)


def test_qwen2_5_vl_on_cuda(tmp_path_factory):
    model = grid.build_model("Qwen2_5_VL", tmp_path_factory.mktemp("qwen"))
    images = [grid.image(0, (70, 50)), grid.image(1, (56, 112))]
    _, tokens, logprobs = grid.reference(model, images)
    request = {"prompt_token_ids": grid.PROMPT, "multi_modal_data": {"image": images}}
    check(model[0], request, tokens, logprobs, skip_tokenizer_init=True)


@pytest.mark.parametrize("make", [deepstack.make_hf, moe.make_hf], ids=["dense", "moe"])
def test_qwen3_vl_on_cuda(tmp_path_factory, make):
    model = deepstack.build_model(tmp_path_factory.mktemp("qwen3"), make)
    images = [grid.image(0, (70, 50)), grid.image(1, (64, 128))]
    _, tokens, logprobs = deepstack.reference(model, images)
    request = {"prompt_token_ids": grid.PROMPT, "multi_modal_data": {"image": images}}
    check(model[0], request, tokens, logprobs, skip_tokenizer_init=True)


def test_mistral3_on_cuda(tmp_path_factory):
    model = rows.build_model(tmp_path_factory.mktemp("mistral3"))
    images = [rows.image(0, (30, 50)), rows.image(1, (50, 20))]
    _, tokens, logprobs = rows.reference(model, images)
    check(model[0], {"prompt": rows.PROMPT, "multi_modal_data": {"image": images}}, tokens,
          logprobs)  # fmt: skip


def test_gemma3_on_cuda(tmp_path_factory):
    model = framed.build_model(tmp_path_factory.mktemp("gemma3"))
    images = [framed.image(0), framed.image(1, (20, 50))]
    _, tokens, logprobs = framed.reference(model, images)
    request = {"prompt": framed.PROMPT, "multi_modal_data": {"image": images}}
    check(model[0], request, tokens, logprobs, max_num_batched_tokens=20)


def test_internvl_on_cuda(tmp_path_factory):
    model = framed_tiles.build_model(tmp_path_factory.mktemp("internvl"))
    images = [framed_tiles.image(0, size) for size in framed_tiles.SIZES]
    _, tokens, logprobs = framed_tiles.reference(model, images)
    request = {"prompt": framed_tiles.PROMPT, "multi_modal_data": {"image": images}}
    check(model[0], request, tokens, logprobs)
