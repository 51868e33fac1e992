"""Cohere's Command models (``models/cohere.py``): tiny Command R (per-head q/k norms) and
Command R7B/A-style (sliding layers that alone rotate, global layers with no position
embedding) checkpoints written by transformers give its logits past the window; GPT-J-style
rotation pairs adjacent dimensions; the engine's greedy tokens equal transformers'."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from tests.tiny_models import TINY_LLAMA, load_cpu_runner
from vllm.config import DEFAULT_MODEL, ModelConfig
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
    runner.initialize_kv_cache(9)
    n = 100
    ids = torch.randint(
        0, TINY_LLAMA["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)
    )
    meta = runner.attn_backend.build_metadata([(0, n, list(range(1, 9)))])
    with torch.inference_mode():
        ours = runner.model.compute_logits(
            runner.model(ids, torch.arange(n), meta, runner.kv_caches)
        )
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
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader import resolve_model

    hf = save("Cohere2", tmp_path, vocab_size=49152, max_position_embeddings=256)
    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{fname}", tmp_path / fname)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 49152, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 49152, (n,), generator=g).tolist() for n in (3, 17, 30)]
    with torch.inference_mode():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    llm = LLM(model=str(tmp_path), kv_cache_memory="16MiB", max_num_batched_tokens=16,
              enable_prefix_caching=True)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
