"""Qwen3-Next and Qwen3.5 (``models/qwen3_next.py``: Gated DeltaNet linear attention with
gated full attention) against transformers on tiny random checkpoints of 4 layers (3
linear, 1 full), 4 value heads over 2 key heads, 4 experts (top 2) with a shared expert:
prompt logits for each of the five architectures; a prompt fed in chunks and decodes over
real recurrent pools and a real KV cache; a step mixing a fresh prefill (its slot stale)
with decodes of other sequences; the checkpoint's tensors, and bf16.

The checkpoints are perturbed so that each part shows: the zero-centred norms (1 +
weight, initialised at 0) away from 0, the gated norm's from 1, decays slow enough for a
state to carry across chunks (``A_log``), a decisive router, a rotation visible within the
prompt (low theta)."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.model_executor.recurrent_checks import (
    check_chunks_continue,
    check_mixed_step,
    hf_logits,
    resaved,
    runner_for,
)
from tests.tiny_models import load_cpu_runner, perturbed, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.layers.gated_delta_net import chunk_gated_delta_rule
from vllm.model_executor.models import qwen3_next
from vllm.model_executor.models.registry import ModelRegistry

VOCAB = 96
LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
TEXT = dict(vocab_size=VOCAB, hidden_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
            layer_types=LAYERS, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6)  # fmt: skip
# 8 of each head's 32 dims rotate; Qwen3.5's M-RoPE sections over their 4 frequencies.
ROPE = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.25}
MROPE = {**ROPE, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=20)  # fmt: skip
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=48,
              patch_size=16, temporal_patch_size=2, spatial_merge_size=2,
              num_position_embeddings=16)  # fmt: skip
MM_TOKENS = dict(image_token_id=90, video_token_id=91, vision_start_token_id=92,
                 vision_end_token_id=93)  # fmt: skip
ARCHS = (
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
IDS = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(1))


def make_config(arch: str):
    if arch == "Qwen3_5ForCausalLM":
        return transformers.Qwen3_5TextConfig(**TEXT, intermediate_size=40, rope_parameters=MROPE)
    if arch == "Qwen3_5MoeForCausalLM":
        return transformers.Qwen3_5MoeTextConfig(**TEXT, **MOE, rope_parameters=MROPE)
    if arch == "Qwen3NextForCausalLM":  # layer 2 dense
        return transformers.Qwen3NextConfig(**TEXT, **MOE, intermediate_size=40,
                                            mlp_only_layers=[2], rope_parameters=ROPE)  # fmt: skip
    if arch == "Qwen3_5ForConditionalGeneration":
        text = dict(TEXT, intermediate_size=40, rope_parameters=MROPE)
        return transformers.Qwen3_5Config(text_config=text, vision_config=VISION, **MM_TOKENS)
    text = dict(TEXT, **MOE, rope_parameters=MROPE)
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **MM_TOKENS)


@functools.cache
def checkpoint(arch: str, root) -> tuple[torch.nn.Module, object]:
    """(transformers' model of ``arch``, seed 0, perturbed; the folder it saved itself in)."""
    torch.manual_seed(0)
    hf = perturbed(getattr(transformers, arch)(make_config(arch)))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):  # decays of 0.05 to 0.5 a token
                p.uniform_(-4.0, -1.5)
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("mlp.gate.weight"):  # the router
                p.normal_(0.0, 0.3)
            elif name.endswith(("gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.15)
        hf.lm_head.weight.normal_(0.0, 0.3)
    path = root / arch
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_next")


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_equal_transformers(arch, root):
    hf, path = checkpoint(arch, root)
    runner = runner_for(path)
    assert type(runner.model).__name__ == arch
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is getattr(qwen3_next, arch)
    ours, ref = runner_logits(runner, IDS[:40]), hf_logits(hf, IDS[:40])
    assert ref.std() > 0.3
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_arch_and_state_specs(root):
    """The KV cache's layers are the full-attention ones; each linear layer declares its
    convolution's last 3 inputs of q, k, v and its (v_heads, k_dim, v_dim) state; Qwen3-Next
    keeps ``mlp_only_layers`` and the layers ``decoder_sparse_step`` skips dense; the
    multimodal classes tie the head by the top-level flag."""
    arch = qwen3_next.Qwen3NextForCausalLM.arch_from_hf(make_config("Qwen3NextForCausalLM"))
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (1, 4, 2, 32)
    assert arch.layer_types == tuple(LAYERS) and arch.sparse_layers == (0, 1, 3)
    assert arch.rope["partial_rotary_factor"] == 0.25 and arch.fused_gdn_projections
    config = make_config("Qwen3NextForCausalLM")
    config.decoder_sparse_step, config.mlp_only_layers = 2, []
    assert qwen3_next.Qwen3NextArch.from_hf(config).sparse_layers == (1, 3)
    model = runner_for(checkpoint("Qwen3_5MoeForCausalLM", root)[1]).model
    assert model.arch.sparse_layers == (0, 1, 2, 3) and not model.arch.fused_gdn_projections
    specs = model.recurrent_state_specs(torch.bfloat16)
    assert len(specs) == 3
    assert [(s.shape, s.dtype) for s in specs[0]] == [
        ((2 * 16 + 48, 3), torch.float32), ((4, 8, 12), torch.bfloat16)
    ]  # fmt: skip
    mm = make_config("Qwen3_5ForConditionalGeneration")
    mm.tie_word_embeddings, mm.text_config.tie_word_embeddings = True, False
    assert qwen3_next.Qwen3_5ForConditionalGeneration.arch_from_hf(mm).tie_word_embeddings


def test_chunk_rule_equals_the_token_by_token_rule():
    """Several chunks with a padded last one, from a state: transformers' per-token rule."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule as reference,
    )

    g = torch.Generator().manual_seed(0)
    t, hk, hv, dk, dv = 11, 2, 4, 8, 6
    q, k = (torch.randn(1, t, hk, dk, generator=g) for _ in range(2))
    v = torch.randn(1, t, hv, dv, generator=g)
    decay = -torch.rand(1, t, hv, generator=g)
    beta = torch.rand(1, t, hv, generator=g)
    state = torch.randn(1, hv, dk, dv, generator=g)
    ref, ref_state = reference(q, k, v, decay, beta, state, True, use_qk_l2norm_in_kernel=True)
    qn, kn = (torch.nn.functional.normalize(x, dim=-1, eps=0) for x in (q, k))
    qn = qn * dk**-0.5
    qn, kn = (x.repeat_interleave(2, dim=2)[0].transpose(0, 1) for x in (qn, kn))
    out, final = chunk_gated_delta_rule(
        qn, kn, v[0].transpose(0, 1), decay[0].T, beta[0].T, state[0], chunk_size=4
    )
    assert torch.allclose(out.transpose(0, 1), ref[0], atol=1e-4)
    assert torch.allclose(final, ref_state[0], atol=1e-4)


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"])
def test_chunks_and_decodes_continue_the_prompt(arch, root):
    """2 + 11 + 1 + 70 tokens (the first chunk shorter than the convolution's state, the
    last longer than the delta rule's chunk of 64), then 3 decodes, in slot 2 of 4: each
    step's last row is the whole forward's row."""
    hf, path = checkpoint(arch, root)
    whole = check_chunks_continue(runner_for(path), IDS, (2, 11, 1, 70, 1, 1, 1))
    assert whole[1:].std() > 0.3


def test_mixed_step_equals_each_sequence_alone(root):
    """One step of [decode of b, a fresh 11-token prompt a, decode of c], a's slot holding a
    stale state; then a decode-only step of all three in another order: every row equals
    transformers' logits of its sequence alone."""
    hf, path = checkpoint("Qwen3_5MoeForCausalLM", root)
    check_mixed_step(hf, runner_for(path), VOCAB)


def test_extra_tensors_are_ignored_and_a_missing_one_is_named(root, tmp_path):
    """A Qwen3.5 multimodal checkpoint with MTP tensors added loads to the same logits (the
    MTP head unread; the tower read for images); one without a layer's ``A_log`` fails naming it."""
    hf, path = checkpoint("Qwen3_5ForConditionalGeneration", root)
    state = load_file(path / "model.safetensors")
    assert any(k.startswith("model.visual.") for k in state)
    extra = {**state, "mtp.fc.weight": torch.randn(48, 96), "mtp.norm.weight": torch.randn(48)}
    runner = load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "extra", extra))))
    assert torch.allclose(runner_logits(runner, IDS), hf_logits(hf, IDS), atol=1e-4)
    missing = dict(state)
    del missing["model.language_model.layers.2.linear_attn.A_log"]
    with pytest.raises(ValueError, match=r"'layers\.2\.linear_attn\.A_log'.* is missing"):
        load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "missing", missing))))


def test_stacked_experts_load(root, tmp_path):
    """Qwen3.5-MoE's tensors as transformers 5 holds them (the experts stacked:
    ``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I))."""
    hf, path = checkpoint("Qwen3_5MoeForConditionalGeneration", root)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 48)
    runner = load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "stacked", state))))
    assert torch.allclose(runner_logits(runner, IDS), hf_logits(hf, IDS), atol=1e-4)


def test_bfloat16_greedy_tokens_mostly_equal_fp32(root):
    """bf16 weights and conv states (a token whose rounding flips a close routing choice
    moves more: transformers' own bf16 logits are 7% off its fp32 ones here)."""
    hf, path = checkpoint("Qwen3NextForCausalLM", root)
    bf16 = runner_for(path, "bfloat16")
    assert bf16.model.layers[0].linear_attn.in_proj.weight.dtype == torch.bfloat16
    assert bf16.model.recurrent_state_specs(torch.float32)[0][0].dtype == torch.bfloat16
    ours = runner_logits(bf16, IDS)
    fp32 = runner_logits(runner_for(path), IDS)
    assert (ours.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8
    assert (ours - fp32).abs().mean() <= 0.1 * fp32.abs().mean()
