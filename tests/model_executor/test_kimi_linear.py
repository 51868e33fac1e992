"""Kimi-Linear (``models/kimi_linear.py``: Kimi Delta Attention with unrotated latent
attention, DeepSeek-V3's experts) against transformers on tiny random checkpoints of 6
layers (4 KDA, 2 MLA; the first dense, then 8 experts top 2 in 2 groups with a shared
expert): KDA's chunked rule against the token-by-token one; prompt logits (q_proj, or the
q LoRA with biases and tie_word_embeddings, which transformers does not honour); a prompt
fed in chunks and decodes over real recurrent pools and a real KV cache; a step mixing a
fresh prefill (its slot stale) with decodes of other sequences; the Hub's tensor names and
transformers' own; the engine's greedy tokens, a next turn restored from a checkpoint of
the states, drafts verified.

The weights are redrawn at unit gain (transformers' 0.02 leaves each layer's output a
rounding error beside the residual stream, where a wrong layer would hide within 1e-4),
norms away from 1 (``perturbed``), decays of 0.3 to 0.99 a token varying by channel
(``A_log``, ``dt_bias``), the experts' selection biases large enough to change choices."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.models.kimi_linear.modeling_kimi_linear import (
    recurrent_kimi_delta_attention,
)

from tests.model_executor.recurrent_checks import (
    check_chunks_continue,
    check_engine_turns,
    check_mixed_step,
    close,
    hf_logits,
    resaved,
    runner_for,
)
from tests.tiny_models import load_cpu_runner, perturbed, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.layers.kda import chunk_kda, recurrent_kda
from vllm.model_executor.models import kimi_linear
from vllm.model_executor.models.registry import ModelRegistry

VOCAB = 96
KINDS = ("linear_attention", "linear_attention", "full_attention") * 2
# The checkpoint's own fields (config.json's names): layers counted from 1.
KDA = {"head_dim": 8, "num_heads": 3, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4, 5],
       "full_attn_layers": [3, 6]}  # fmt: skip
BASE = dict(hidden_size=48, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=12, v_head_dim=10, num_experts=8, num_experts_per_token=2,
            num_shared_experts=1, num_expert_group=2, topk_group=1, first_k_dense_replace=1,
            routed_scaling_factor=1.5, linear_attn_config=KDA, model_max_length=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
CASES = {
    "kimi": dict(q_lora_rank=None),
    "kimi_q_lora": dict(q_lora_rank=24, attention_bias=True, tie_word_embeddings=True),
}
IDS = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(1))


def make_config(case: str = "kimi", vocab: int = VOCAB, **overrides):
    return transformers.KimiLinearConfig(vocab_size=vocab, **{**BASE, **CASES[case], **overrides})


def random_model(case: str = "kimi", vocab: int = VOCAB) -> torch.nn.Module:
    """transformers' model of ``case``, seed 0, redrawn and perturbed (module docstring)."""
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(make_config(case, vocab))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "embed_tokens" in name or name == "lm_head.weight":
                p.normal_(0.0, 0.3)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, p.shape[2] ** -0.5)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
        perturbed(hf)
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 0.5)
            elif name.endswith("dt_bias"):
                p.normal_(-2.0, 0.5)
    return hf


@functools.cache
def checkpoint(case: str, root) -> tuple[torch.nn.Module, object]:
    """(transformers' model of ``case``; the folder it saved itself in)."""
    hf = random_model(case)
    path = root / case
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("kimi_linear")


def kda_inputs(t: int, heads: int = 3, dk: int = 8, dv: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, t, heads, dk, generator=g) for _ in range(2))
    v = torch.randn(1, t, heads, dv, generator=g)
    decay = -torch.rand(1, t, heads, dk, generator=g)
    beta = torch.rand(1, t, heads, generator=g)
    state = torch.randn(1, heads, dk, dv, generator=g)
    return q, k, v, decay, beta, state


def ours(q, k, v, decay, beta, state, chunk_size: int):
    """Our chunked rule on transformers' (1, T, H, D) inputs: q, k normalised and q scaled
    as the layer does -> (o (T, H, Dv), the last state)."""
    qn, kn = (torch.nn.functional.normalize(x[0], dim=-1, eps=0) for x in (q, k))
    qn = qn * q.shape[-1] ** -0.5
    head_major = (x.transpose(0, 1) for x in (qn, kn, v[0], decay[0], beta[0]))
    o, last = chunk_kda(*head_major, state[0], chunk_size=chunk_size)
    return o.transpose(0, 1), last


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 64])
def test_chunk_rule_equals_the_token_by_token_rule(chunk_size):
    """11 tokens in chunks of 1, 4 (a short last one), 5 and 64 (one), from a state:
    transformers' per-token rule, and our one-token update step by step."""
    q, k, v, decay, beta, state = kda_inputs(11)
    ref, ref_state = recurrent_kimi_delta_attention(
        q, k, v, decay, beta, state, True, use_qk_l2norm_in_kernel=True
    )
    out, last = ours(q, k, v, decay, beta, state, chunk_size)
    close(out, ref[0])
    close(last, ref_state[0])
    qn, kn = (torch.nn.functional.normalize(x[0], dim=-1, eps=0) for x in (q, k))
    s = state
    for t in range(11):
        o, s = recurrent_kda(qn[None, t] * q.shape[-1] ** -0.5, kn[None, t], v[:, t], decay[:, t],
                             beta[:, t], s)  # fmt: skip
        close(o[0], ref[0, t], t)
    close(s[0], ref_state[0])


def test_strong_decays_stay_finite_in_a_chunk():
    """Channels decaying by e^-40 a token beside slow ones, over chunks of 16: no overflow
    (the pairwise decays are never a ratio of exponentials), the per-token rule's result."""
    q, k, v, decay, beta, state = kda_inputs(40, seed=1)
    decay[..., ::2] *= 40  # every other key channel forgets at once
    ref, ref_state = recurrent_kimi_delta_attention(
        q, k, v, decay, beta, state, True, use_qk_l2norm_in_kernel=True
    )
    out, last = ours(q, k, v, decay, beta, state, 16)
    assert torch.isfinite(out).all() and torch.isfinite(last).all()
    close(out, ref[0])
    close(last, ref_state[0])


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_equal_transformers(case, root):
    hf, path = checkpoint(case, root)
    runner = runner_for(path)
    resolved = ModelRegistry.resolve_model_cls(hf.config)[0]
    assert resolved is kimi_linear.KimiLinearForCausalLM
    ref = hf_logits(hf, IDS)
    assert ref.std() > 0.3
    close(runner_logits(runner, IDS), ref)


def test_arch_and_state_specs(root):
    """The KV cache's layers are the MLA ones, one latent head of kv_lora_rank +
    qk_rope_head_dim; the layer kinds come from linear_attn_config (counted from 1); the
    first layer is dense; each KDA layer declares its q, k, v convolutions' last 3 inputs
    and its (heads, head_dim, head_dim) state; what transformers does not compute is
    refused, naming the field."""
    model = runner_for(checkpoint("kimi", root)[1]).model
    a = model.arch
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == (2, 4, 1, 24)
    assert a.latent_value_size == 16 and a.rope is None
    assert a.layer_types == KINDS and a.sparse_layers == (1, 2, 3, 4, 5)
    assert (a.mla.num_groups, a.mla.topk_groups, a.mla.num_experts_per_tok) == (2, 1, 2)
    assert a.mla.norm_topk_prob and a.mla.routed_scaling_factor == 1.5
    specs = model.recurrent_state_specs(torch.bfloat16)
    assert [[(s.shape, s.dtype) for s in layer] for layer in specs] == (
        [[((72, 3), torch.float32), ((3, 8, 8), torch.bfloat16)]] * 4
    )  # fmt: skip
    refused = {
        "mla_use_nope": dict(mla_use_nope=False),
        "num_key_value_heads": dict(num_key_value_heads=2),
        "moe_router_activation_func": dict(moe_router_activation_func="softmax"),
        "use_full_rank_gate": dict(linear_attn_config={**KDA, "use_full_rank_gate": True}),
        "num_expert_group": dict(num_expert_group=8),
    }
    for field, overrides in refused.items():
        with pytest.raises(ValueError, match=field):
            kimi_linear.KimiLinearArch.from_hf(make_config(**overrides))


def test_chunks_and_decodes_continue_the_prompt(root):
    """2 + 11 + 1 + 70 tokens (the first chunk shorter than the convolution's state, a
    one-token chunk through the decode update, the last longer than the rule's chunk of
    64), then 3 decodes, in slot 2 of 4: each step's last row is the whole forward's row."""
    _, path = checkpoint("kimi", root)
    whole = check_chunks_continue(runner_for(path), IDS, (2, 11, 1, 70, 1, 1, 1))
    assert whole[1:].std() > 0.3


def test_mixed_step_equals_each_sequence_alone(root):
    """One step of [decode of b, a fresh 11-token prompt a, decode of c], a's slot holding a
    stale state; then a decode-only step of all three in another order: every row equals
    transformers' logits of its sequence alone."""
    hf, path = checkpoint("kimi", root)
    check_mixed_step(hf, runner_for(path), VOCAB)


def test_checkpoint_names_load_and_a_missing_tensor_is_named(root, tmp_path):
    """What ``save_pretrained`` writes is the Hub's layout (the decay's tensors on the
    attention, q/k/v convolutions apart, ``block_sparse_moe`` with experts one by one);
    the tensors under transformers' own names (``forget_gate``, one ``conv1d``, stacked
    experts under ``mlp``) load to the same logits; a checkpoint without one of its
    tensors fails naming it."""
    hf, path = checkpoint("kimi", root)
    saved = load_file(path / "model.safetensors")
    hub = ("self_attn.q_conv1d.weight", "self_attn.f_a_proj.weight", "self_attn.dt_bias",
           "block_sparse_moe.experts.7.w3.weight", "block_sparse_moe.gate.weight")  # fmt: skip
    assert all(f"model.layers.1.{name}" in saved for name in hub)
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in saved  # the dense MLP too
    assert saved["model.layers.1.self_attn.A_log"].shape == (1, 1, 3, 1)
    own = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.self_attn.forget_gate.A_log" in own
    assert "model.layers.1.mlp.experts.gate_up_proj" in own
    runner = load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "own", own))))
    close(runner_logits(runner, IDS), hf_logits(hf, IDS))
    del saved["model.layers.4.self_attn.f_b_proj.weight"]
    with pytest.raises(ValueError, match=r"'layers\.4\.self_attn\.f_b_proj\.weight' is missing"):
        load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "missing", saved))))


def test_engine_greedy_next_turn_and_drafts_match_transformers(tmp_path, monkeypatch):
    """``check_engine_turns``: chunks, mixed batches, a next turn restored from a
    checkpoint of the KDA states, drafts verified with the states rolled back."""
    check_engine_turns(random_model("kimi", 49152), tmp_path, 49152, monkeypatch)


def test_bfloat16_stays_close_to_fp32(root):
    """bf16 weights and convolution states: the greedy tokens mostly fp32's."""
    _, path = checkpoint("kimi", root)
    bf16 = runner_for(path, "bfloat16")
    assert bf16.model.layers[0].self_attn.in_proj.weight.dtype == torch.bfloat16
    assert bf16.model.recurrent_state_specs(torch.float32)[0][0].dtype == torch.bfloat16
    ours_, fp32 = runner_logits(bf16, IDS), runner_logits(runner_for(path), IDS)
    assert (ours_.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8
    assert (ours_ - fp32).abs().mean() <= 0.1 * fp32.abs().mean()
