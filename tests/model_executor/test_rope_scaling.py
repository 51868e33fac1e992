"""Rotary scaling types (``layers/rotary_embedding.py``): llama3 (Llama 3.1/3.2), linear
and yarn frequencies against transformers' own, and a tiny checkpoint of each whose logits
equal transformers' at positions past the original context, where the types differ."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.tiny_models import TINY_LLAMA, load_cpu_runner, runner_logits
from vllm.model_executor.layers.rotary_embedding import (
    inverse_frequencies,
    rope_parameters,
)
from vllm.model_executor.model_loader import model_max_len

# head_dim 16, theta 10000: wavelengths 6.3, 19.9, 62.8 ... 19,869 positions.
SCALINGS = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32),
    "linear": dict(rope_type="linear", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    "yarn-mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                        mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2),
}  # fmt: skip


def config(name: str, arch: str = "Llama", **overrides):
    rope = {"rope_theta": 10000.0, **SCALINGS[name]} if name != "default" else None
    fields = {**TINY_LLAMA, "max_position_embeddings": 128, **overrides}
    return getattr(transformers, f"{arch}Config")(**fields, rope_parameters=rope)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_frequencies_and_attention_factor_equal_transformers(name):
    c = config(name)
    ours, factor = inverse_frequencies(16, rope_parameters(c))
    ref, ref_factor = ROPE_INIT_FUNCTIONS[SCALINGS[name]["rope_type"]](c, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-9)
    default, _ = inverse_frequencies(16, rope_parameters(config("default")))
    assert not torch.equal(ours, default)  # the type changes something


def test_old_rope_scaling_key_and_type_name_are_read():
    c = transformers.LlamaConfig(**TINY_LLAMA)
    c.rope_parameters = None
    c.rope_scaling = {"type": "linear", "factor": 3.0}
    c.rope_theta = 500.0
    params = rope_parameters(c)
    assert params["rope_type"] == "linear" and params["rope_theta"] == 500.0


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic' is not supported yet .*llama3"),
        ({"rope_type": "longrope", "factor": 2.0}, "longrope rope parameters lack short_factor"),
        ({"rope_type": "llama3", "factor": 8.0}, "lack .*original_max_position_embeddings"),
        ({"rope_type": "linear"}, "lack factor"),
        (
            {"rope_type": "default", "partial_rotary_factor": 1.5},
            r"partial_rotary_factor 1.5 .*\(0, 1\]",
        ),
    ],
)
def test_unsupported_or_incomplete_rope_parameters_are_refused(scaling, match):
    c = transformers.LlamaConfig(**TINY_LLAMA)
    c.rope_parameters = {"rope_theta": 10000.0, **scaling}
    with pytest.raises(ValueError, match=match):
        rope_parameters(c)


def test_model_max_len_stretches_for_linear_only():
    assert model_max_len(config("linear")) == 256
    assert model_max_len(config("llama3")) == 128  # Llama 3.1's config counts it already
    assert model_max_len(config("yarn")) == 128


@pytest.mark.parametrize(
    "name, arch", [("llama3", "Llama"), ("linear", "Llama"), ("yarn", "Qwen2"),
                   ("yarn-mscale", "Llama")],
)  # fmt: skip
def test_tiny_checkpoint_logits_equal_transformers_past_the_original_length(name, arch, tmp_path):
    from vllm.config import ModelConfig

    torch.manual_seed(0)
    hf = getattr(transformers, f"{arch}ForCausalLM")(config(name, arch)).eval()
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    n = 120  # well past the original 32 positions
    ids = torch.randint(
        0, TINY_LLAMA["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)
    )
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def phi3_config(**overrides):
    """A tiny Phi-3.5/Phi-4-mini-style config: longrope over an original 32 positions,
    three quarters of each 16-dimension head rotating (6 pairs)."""
    g = torch.Generator().manual_seed(5)
    fields = dict(
        TINY_LLAMA, max_position_embeddings=128, original_max_position_embeddings=32,
        partial_rotary_factor=0.75, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        rope_scaling={"type": "longrope",
                      "short_factor": (1 + torch.rand(6, generator=g)).tolist(),
                      "long_factor": (2 + 4 * torch.rand(6, generator=g)).tolist()},
    )  # fmt: skip
    return transformers.Phi3Config(**{**fields, **overrides})


@pytest.mark.parametrize("long", [False, True])
def test_longrope_and_partial_frequencies_equal_transformers(long):
    from vllm.model_executor.layers.rotary_embedding import rotary_dim, use_long_rope

    c = phi3_config()
    use_long_rope(c, 128 if long else 32)
    params = rope_parameters(c)
    assert rotary_dim(16, params) == 12 and params["long_rope"] is long
    ours, factor = inverse_frequencies(rotary_dim(16, params), params)
    ref, ref_factor = ROPE_INIT_FUNCTIONS["longrope"](c, "cpu", seq_len=33 if long else 32)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-9) and factor > 1
    assert model_max_len(c) == 128  # the config counts the extension already


def test_partial_rotary_leaves_the_other_dimensions_alone():
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding import cos_sin_cache

    params = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}
    cache = cos_sin_cache(16, 64, params)
    assert cache.shape == (64, 8)
    q, k = torch.randn(5, 2 * 16), torch.randn(5, 16)
    q0, k0 = q.clone(), k.clone()
    ops.rotary_embedding(torch.arange(5) * 7, q, k, 16, cache)
    for x, x0 in ((q, q0), (k, k0)):
        heads, heads0 = x.view(5, -1, 16), x0.view(5, -1, 16)
        assert torch.equal(heads[..., 8:], heads0[..., 8:])
        assert not torch.allclose(heads[1:, :, :8], heads0[1:, :, :8])
        torch.testing.assert_close(heads.norm(dim=-1), heads0.norm(dim=-1))  # a rotation


@pytest.mark.parametrize("max_model_len, n", [(128, 100), (32, 30)])
def test_phi3_longrope_partial_checkpoint_logits_equal_transformers(max_model_len, n, tmp_path):
    """Long factors when serving past the original 32 positions (transformers' too for a
    100-token sequence), short ones when serving within them."""
    from vllm.config import ModelConfig

    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(phi3_config()).eval()
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=max_model_len))
    assert runner.arch.rope["long_rope"] is (max_model_len > 32)
    ids = torch.randint(
        0, TINY_LLAMA["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)
    )
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
