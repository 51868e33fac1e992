"""gpt-oss (``models/gpt_oss.py``): a tiny checkpoint written by transformers gives its
logits (attention sinks, sliding windows, yarn, biased router and experts, the clamped
SwiGLU); MXFP4 experts expand as transformers expands them, and a checkpoint holding them
so gives the logits of the same model with the expanded weights; the engine's greedy tokens
equal transformers' ``generate``."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.tiny_models import (
    TINY_LLAMA,
    check_engine_greedy_matches,
    load_cpu_runner,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM, deinterleave, dequantize_mxfp4
from vllm.model_executor.models.registry import ModelRegistry

TINY_GPT_OSS = dict(
    TINY_LLAMA, intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    sliding_window=12, max_position_embeddings=128, pad_token_id=0, eos_token_id=1,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "rope_theta": 10000.0},
)  # fmt: skip


def gpt_oss_config(**overrides):
    config = transformers.GptOssConfig(**{**TINY_GPT_OSS, **overrides})
    config._attn_implementation = "eager"
    return config


def hf_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(gpt_oss_config(**overrides)).eval()
    with torch.no_grad():  # what transformers starts at 0 or near it, made to matter
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.uniform_(-1.0, 3.0)
            elif name.endswith("_bias") or name.endswith("router.bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0.0, 0.5)  # past the SwiGLU's clamp at 7 for some rows
    return model


IDS = torch.randint(0, TINY_LLAMA["vocab_size"], (100,), generator=torch.Generator().manual_seed(1))


def test_gpt_oss_checkpoint_logits_equal_transformers(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is GptOssForCausalLM
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert runner.arch.sliding_windows == (12, None)
    assert runner.attn_backend.name == "TORCH_SDPA"
    ours = runner_logits(runner, IDS)
    with torch.inference_mode():
        ref = hf(IDS[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    # The sinks matter here: without them (a sink of -inf) transformers' logits move.
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e9)
        assert (hf(IDS[None]).logits[0].float() - ours).abs().max() > 1e-3


def test_the_clamped_swiglu_and_the_interleaving():
    from vllm.model_executor.layers.fused_moe import swiglu_oai

    t = torch.arange(12.0).view(2, 6)
    assert deinterleave(t, 1).tolist() == [[0, 2, 4, 1, 3, 5], [6, 8, 10, 7, 9, 11]]
    h = torch.tensor([[10.0, -1.0, 9.0, -9.0]])  # gate [10, -1], up [9, -9]
    out = swiglu_oai(h, 1.702, 7.0)
    gate = torch.tensor([7.0, -1.0])
    expected = (torch.tensor([7.0, -7.0]) + 1) * gate * torch.sigmoid(1.702 * gate)
    torch.testing.assert_close(out[0], expected)


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed ``blocks (*shape, 16)`` and ``scales shape`` near 2 ** 0."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(124, 129, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_expands_as_transformers_expands_it():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 8, 2), seed=0)  # 3 experts, 8 rows, 64 columns
    ours = dequantize_mxfp4(blocks, scales)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, cols, rows)
    assert ours.shape == (3, 8, 64)
    torch.testing.assert_close(ours, ref.transpose(1, 2), rtol=0, atol=0)
    # One group of one byte: low nibble 1 (0.5), high nibble 2 (1.0), times 2 ** (128 - 127).
    one = dequantize_mxfp4(
        torch.tensor([[0x21]], dtype=torch.uint8), torch.tensor([128], dtype=torch.uint8)
    )
    assert one.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_mxfp4(blocks, scales[:, :, :1])


def save_mxfp4_checkpoint(path, **overrides) -> torch.nn.Module:
    """The tiny model saved in ``path`` with its experts as the released checkpoints hold
    them (``*_blocks`` / ``*_scales``); returned with the values they expand to."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_model(**overrides)
    hf.save_pretrained(path)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    c = hf.config
    hidden, inter, experts = c.hidden_size, c.intermediate_size, c.num_local_experts
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            p = f"model.layers.{i}.mlp.experts."
            shapes = (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter))
            for name, rows, cols in shapes:
                blocks, scales = random_mxfp4((experts, rows, cols // 32), seed=10 * i + rows)
                scales -= 3  # values / 8: near the scale of the other weights
                # transformers' own parameter, (E, cols, rows), holds what they expand to
                expanded = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                getattr(layer.mlp.experts, name).copy_(expanded)
                del sd[p + name]
                sd[p + name + "_blocks"], sd[p + name + "_scales"] = blocks, scales
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in sd.items()}, path / "model.safetensors")
    return hf


def test_mxfp4_checkpoint_gives_the_logits_of_its_expanded_weights(tmp_path):
    """The released checkpoints' layout: experts as ``*_blocks`` / ``*_scales``, expanded
    on the CPU (packed on CUDA: tests/cuda/test_moe_cuda.py)."""
    hf = save_mxfp4_checkpoint(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert not runner.model.layers[0].mlp.experts.mxfp4
    ours = runner_logits(runner, IDS)
    with torch.inference_mode():
        ref = hf(IDS[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_mxfp4_experts_are_built_packed_only_with_cuda_and_triton(monkeypatch):
    from vllm.model_executor.layers import triton_mxfp4_moe
    from vllm.model_executor.models import gpt_oss

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_mxfp4_moe, "triton", object())
    monkeypatch.delenv("VLLM_MXFP4_MOE", raising=False)
    assert gpt_oss.keep_mxfp4_packed()
    monkeypatch.setenv("VLLM_MXFP4_MOE", "dequantize")
    assert not gpt_oss.keep_mxfp4_packed()
    monkeypatch.setenv("VLLM_MXFP4_MOE", "AUTO")
    assert gpt_oss.keep_mxfp4_packed()
    monkeypatch.setattr(triton_mxfp4_moe, "triton", None)
    assert not gpt_oss.keep_mxfp4_packed()
    monkeypatch.setenv("VLLM_MXFP4_MOE", "packed")
    with pytest.raises(ValueError, match="VLLM_MXFP4_MOE"):
        gpt_oss.keep_mxfp4_packed()


def test_packed_experts_loaded_on_the_cpu_are_expanded(tmp_path, monkeypatch):
    """Built packed (a machine with CUDA) but loaded on the CPU, where the kernel cannot
    run: expanded as the load starts, the logits those of the expanded weights."""
    from vllm.model_executor.models import gpt_oss

    hf = save_mxfp4_checkpoint(tmp_path)
    monkeypatch.setattr(gpt_oss, "keep_mxfp4_packed", lambda: True)
    with torch.device("meta"):
        built = GptOssForCausalLM(GptOssForCausalLM.arch_from_hf(hf.config))
        odd = GptOssForCausalLM(GptOssForCausalLM.arch_from_hf(gpt_oss_config(hidden_size=48)))
    assert built.layers[0].mlp.experts.mxfp4
    assert not odd.layers[0].mlp.experts.mxfp4  # no MXFP4 checkpoint has rows of 48
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert not any(layer.mlp.experts.mxfp4 for layer in runner.model.layers)
    ours = runner_logits(runner, IDS)
    with torch.inference_mode():
        ref = hf(IDS[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """Chunked prefill over the 12-token windows, batched decodes, a prefix hit."""
    hf = hf_model(vocab_size=49152)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    check_engine_greedy_matches(hf, tmp_path)
