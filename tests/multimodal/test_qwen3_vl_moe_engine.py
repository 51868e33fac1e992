"""Qwen3-VL-MoE images through the engine: test_qwen3_vl_engine.py's scenario (greedy tokens
and logprobs equal transformers' ``generate``, whole and in prefill chunks of 5 that cut the
images, from the prefix cache, beside a request with other images) on the tiny random
model of tests/model_executor/test_qwen3_vl_moe.py (4 experts, top-2, a dense layer)."""

from __future__ import annotations

import pytest

from tests.model_executor.test_qwen3_vl_moe import make_hf
from tests.multimodal.test_qwen3_vl_engine import build_model
from tests.multimodal.test_qwen3_vl_engine import (
    test_images_with_deepstack_equal_transformers as images_equal_transformers,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("qwen3_vl_moe"), make_hf)


def test_images_with_experts_equal_transformers(model):
    images_equal_transformers(model)
