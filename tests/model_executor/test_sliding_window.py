"""Sliding-window attention per layer (``model_loader.layer_sliding_windows``, the torch
backend's masked path): which layers slide for each config, contexts no longer capped at the
window, and Mistral v0.1 / Qwen2 checkpoints whose logits and greedy tokens past the window
equal transformers'."""

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
from vllm.model_executor.model_loader import layer_sliding_windows, model_max_len


@pytest.mark.parametrize(
    "arch, fields, expected",
    [
        ("Mistral", dict(sliding_window=48), (48, 48)),  # Mistral v0.1: every layer slides
        ("Mistral", dict(sliding_window=None), (None, None)),  # v0.3
        ("Qwen2", dict(sliding_window=48, use_sliding_window=True, max_window_layers=1),
         (None, 48)),  # layers from max_window_layers on
        ("Qwen2", dict(sliding_window=48, use_sliding_window=False), (None, None)),
        ("Gemma2", dict(sliding_window=48), (48, None)),  # alternating
        ("Llama", {}, (None, None)),
    ],
)  # fmt: skip
def test_which_layers_slide(arch, fields, expected):
    c = getattr(transformers, f"{arch}Config")(**{**TINY_LLAMA, "max_position_embeddings": 128},
                                               **fields)  # fmt: skip
    assert layer_sliding_windows(c) == expected
    assert model_max_len(c) == 128  # the window no longer caps the context


def test_layer_types_must_cover_the_layers():
    c = transformers.Gemma2Config(**TINY_LLAMA)
    c.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match="layer_types lists 1 layers, the model has 2"):
        layer_sliding_windows(c)


def save(arch: str, path, **fields) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**{**TINY_LLAMA, **fields})
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize(
    "arch, fields",
    [("Mistral", dict(sliding_window=16)),
     ("Qwen2", dict(sliding_window=16, use_sliding_window=True, max_window_layers=1))],
)  # fmt: skip
def test_logits_past_the_window_equal_transformers(arch, fields, tmp_path):
    hf = save(arch, tmp_path, **fields)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert runner.attn_backend.name == "TORCH_SDPA"
    n = 100
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (n,), generator=g)
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
        # The window matters here: the same model attending to everything differs.
        hf.config.sliding_window = None
        hf.config.layer_types = ["full_attention"] * hf.config.num_hidden_layers
        full = type(hf)(hf.config).eval()
        full.load_state_dict(hf.state_dict())
        unwindowed = full(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    assert (unwindowed[20:] - ref[20:]).abs().max() > 1e-3


def test_engine_greedy_tokens_past_the_window_equal_transformers_generate(tmp_path):
    """Chunked prefill (16-token chunks over a 12-token window), batched decodes and a prefix
    hit on a Mistral v0.1-style checkpoint: transformers' greedy tokens."""
    hf = save("Mistral", tmp_path, sliding_window=12, vocab_size=49152, max_position_embeddings=256)
    check_engine_greedy_matches(hf, tmp_path)


def test_disable_sliding_window_caps_the_context_and_keeps_the_layers_rotations(tmp_path):
    """vLLM's --disable-sliding-window: every layer attends to everything, the context
    stops at the window, and Gemma 3's sliding layers keep their own rotation."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import hf_config_of
    from vllm.model_executor.models.gemma import GemmaForCausalLM

    mistral = transformers.MistralConfig(**{**TINY_LLAMA, "max_position_embeddings": 128},
                                         sliding_window=48)  # fmt: skip
    assert model_max_len(mistral) == 128 and model_max_len(mistral, True) == 48
    assert model_max_len(transformers.LlamaConfig(**TINY_LLAMA), True) == 128  # no window

    torch.manual_seed(0)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    config = transformers.Gemma3TextConfig(
        **{**TINY_LLAMA, "head_dim": 16, "max_position_embeddings": 128}, sliding_window=40,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=rope,
    )  # fmt: skip
    hf = transformers.Gemma3ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    args = EngineArgs(model=str(tmp_path), disable_sliding_window=True)
    vllm_config: VllmConfig = args.create_engine_config(model_max_len(config, True))
    assert vllm_config.scheduler_config.max_model_len == 40
    model_config = vllm_config.model_config
    assert hf_config_of(model_config).sliding_window is None
    runner = load_cpu_runner(vllm_config)
    assert isinstance(runner.model, GemmaForCausalLM)
    assert runner.arch.sliding_windows == (None, None)
    assert runner.arch.sliding_layers == (True, False)
    assert runner.model.attention_features == frozenset()
    n = 40
    ids = torch.randint(
        0, TINY_LLAMA["vocab_size"], (n,), generator=torch.Generator().manual_seed(2)
    )
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()  # within the window: the same attention
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
