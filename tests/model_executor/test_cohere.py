"""Cohere's Command models (``models/cohere.py``): tiny Command R (per-head q/k norms) and
Command R7B/A-style (sliding layers that alone rotate, global layers with no position
embedding) checkpoints written by transformers give its logits past the window; GPT-J-style
rotation pairs adjacent dimensions; the engine's greedy tokens equal transformers'."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.tiny_models import (
    TINY_LLAMA,
    check_engine_greedy_matches,
    load_cpu_runner,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.cohere import CohereForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

COHERE = {
    "Cohere": dict(use_qk_norm=True, logit_scale=0.5),
    "Cohere2": dict(sliding_window=12, num_hidden_layers=4, logit_scale=0.25,
                    layer_types=["sliding_attention", "sliding_attention", "sliding_attention",
                                 "full_attention"]),
}  # fmt: skip


def save(name: str, path, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = {**TINY_LLAMA, "tie_word_embeddings": True, "pad_token_id": 0, **COHERE[name]}
    config = getattr(transformers, f"{name}Config")(**{**fields, **overrides})
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("name", list(COHERE))
def test_cohere_logits_equal_transformers(name, tmp_path):
    hf = save(name, tmp_path)
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is CohereForCausalLM
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a = runner.arch
    if name == "Cohere2":
        assert a.sliding_windows == (12, 12, 12, None)
        assert a.rope_layers == (True, True, True, False)
    else:
        assert a.qk_norm and a.rope_layers == (True, True)
    n = 100
    ids = torch.randint(
        0, TINY_LLAMA["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)
    )
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_interleaved_rotation_pairs_adjacent_dimensions():
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding import cos_sin_cache

    cache = cos_sin_cache(4, 8, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.tensor([[1.0, 0.0, 1.0, 0.0]]), torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    ops.rotary_embedding_interleaved(torch.tensor([3]), q, k, 4, cache)
    cos, sin = cache[3, :2], cache[3, 2:]
    # (x0, x1) rotates by pair 0's angle, (x2, x3) by pair 1's.
    expected_q = torch.stack((cos, sin), -1).flatten()
    torch.testing.assert_close(q[0], expected_q)
    torch.testing.assert_close(k[0], torch.stack((-sin, cos), -1).flatten())


def test_cohere2_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    hf = save("Cohere2", tmp_path, vocab_size=49152, max_position_embeddings=256)
    check_engine_greedy_matches(hf, tmp_path, prefix_hit=False)
