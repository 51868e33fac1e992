"""LFM2 and LFM2-MoE (``models/lfm2.py``: gated short convolutions with attention) against
transformers on tiny random checkpoints: prompt logits; a prompt fed in chunks and decodes
over real recurrent pools and a real KV cache; a step mixing a fresh prefill (its slot
stale) with decodes of other sequences; the Hub's tensor names and transformers 5's; and
the engine's greedy tokens, a job's next turn restored from a checkpoint of the states.

Each checkpoint has two attention and three convolution layers. Its weights are redrawn at
unit gain (transformers' 0.02 leaves each layer's output a rounding error beside the
residual stream, where a wrong layer would hide within 1e-4), norms away from 1, biases
from 0 (``perturbed``), the experts' selection biases large enough to change choices."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers
from safetensors.torch import load_file

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
from vllm.model_executor.models import lfm2
from vllm.model_executor.models.registry import ModelRegistry

VOCAB = 96
KINDS = ["conv", "full_attention", "conv", "conv", "full_attention"]
BASE = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=5,
            conv_L_cache=4, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 100.0})  # fmt: skip
# name: (transformers class, its config's class and fields): tied, its MLP width derived
# (int(2 * 60 / 3) * 1.5 = 60, rounded up to 64); untied with the convolutions' biases and
# the layers given by full_attn_idxs (the Hub's older field); LFM2-MoE with two dense
# layers, then experts (top 2 of 4), its selection bias and scaling.
CASES = {
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config",
             dict(BASE, layer_types=KINDS, intermediate_size=60, block_multiple_of=16,
                  block_ffn_dim_multiplier=1.5)),
    "lfm2_bias_untied": ("Lfm2ForCausalLM", "Lfm2Config",
                         dict(BASE, full_attn_idxs=[1, 4], intermediate_size=40,
                              block_auto_adjust_ff_dim=False, conv_bias=True,
                              tie_word_embeddings=False)),
    "lfm2_moe": ("Lfm2MoeForCausalLM", "Lfm2MoeConfig",
                 dict(BASE, layer_types=KINDS, intermediate_size=40, num_dense_layers=2,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      routed_scaling_factor=1.5)),
}  # fmt: skip
IDS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))


def make_config(case: str, vocab: int = VOCAB, **overrides):
    _, config, fields = CASES[case]
    return getattr(transformers, config)(vocab_size=vocab, **{**fields, **overrides})


def random_model(case: str, vocab: int = VOCAB, **overrides) -> torch.nn.Module:
    """transformers' model of ``case`` (its config's fields ``overrides``), seed 0, its
    matrices redrawn at unit gain and perturbed (module docstring)."""
    torch.manual_seed(0)
    hf = getattr(transformers, CASES[case][0])(make_config(case, vocab, **overrides))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "embed_tokens" in name or name == "lm_head.weight":
                p.normal_(0.0, 0.3)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
            elif name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.normal_(0.0, p.shape[2] ** -0.5)
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0.0, 0.5)
    return perturbed(hf)


@functools.cache
def checkpoint(case: str, root) -> tuple[torch.nn.Module, object]:
    """(transformers' model of ``case``; the folder it saved itself in)."""
    hf = random_model(case)
    path = root / case
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("lfm2")


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_equal_transformers(case, root):
    hf, path = checkpoint(case, root)
    runner = runner_for(path)
    arch = CASES[case][0]
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is getattr(lfm2, arch)
    ref = hf_logits(hf, IDS)
    assert ref.std() > 0.3
    close(runner_logits(runner, IDS), ref)


def test_arch_and_state_specs(root):
    """The KV cache's layers are the attention ones; each convolution layer declares its
    last 3 inputs (hidden, conv_L_cache - 1) in the weights' dtype; the MLP widths are
    transformers'; the head is tied as the config says; a layer kind transformers does
    not know is refused."""
    model = runner_for(checkpoint("lfm2", root)[1]).model
    a = model.arch
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == (2, 4, 2, 12)
    assert a.layer_types == tuple(KINDS) and a.intermediate_size == 64
    assert a.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    specs = model.recurrent_state_specs(torch.bfloat16)
    assert [[(s.shape, s.dtype) for s in layer] for layer in specs] == (
        [[((48, 3), torch.float32)]] * 3
    )  # fmt: skip
    untied = lfm2.Lfm2Arch.from_hf(make_config("lfm2_bias_untied"))
    assert untied.layer_types == tuple(KINDS) and untied.intermediate_size == 40
    assert untied.conv_bias and not untied.tie_word_embeddings
    moe = lfm2.Lfm2Arch.from_hf(make_config("lfm2_moe"))
    assert moe.intermediate_size == 40 and moe.sparse_layers == (2, 3, 4)
    assert moe.expert_bias and moe.routed_scaling_factor == 1.5
    with pytest.raises(ValueError, match="layer_types"):
        lfm2.Lfm2Arch.from_hf(make_config("lfm2", layer_types=[*KINDS[:-1], "sliding_attention"]))


@pytest.mark.parametrize("case", ["lfm2_bias_untied", "lfm2_moe"])
def test_chunks_and_decodes_continue_the_prompt(case, root):
    """2 + 11 + 1 + 23 tokens (the first chunk shorter than the convolution's state, a
    one-token chunk through the decode update), then 3 decodes, in slot 2 of 4: each
    step's last row is the whole forward's row."""
    _, path = checkpoint(case, root)
    check_chunks_continue(runner_for(path), IDS, (2, 11, 1, 23, 1, 1, 1))


@pytest.mark.parametrize("case", ["lfm2", "lfm2_moe"])
def test_mixed_step_equals_each_sequence_alone(case, root):
    """One step of [decode of b, a fresh 11-token prompt a, decode of c], a's slot holding a
    stale state; then a decode-only step of all three in another order: every row equals
    transformers' logits of its sequence alone."""
    hf, path = checkpoint(case, root)
    check_mixed_step(hf, runner_for(path), VOCAB)


@pytest.mark.parametrize(
    "case, removed",
    [("lfm2_bias_untied", "model.layers.3.conv.conv.bias"),
     ("lfm2_moe", "model.layers.4.feed_forward.experts.3.w3.weight")],
)  # fmt: skip
def test_checkpoint_names_load_and_a_missing_tensor_is_named(case, removed, root, tmp_path):
    """What ``save_pretrained`` writes is the Hub's layout (LFM2-MoE's experts one by one,
    ``experts.E.w1`` / ``w3`` / ``w2``); the tensors as transformers 5 holds them
    (``experts.gate_up_proj`` / ``down_proj`` stacked) load to the same logits; a
    checkpoint without one of its tensors fails naming it."""
    hf, path = checkpoint(case, root)
    saved = load_file(path / "model.safetensors")
    assert removed in saved and "model.embedding_norm.weight" in saved
    assert ("lm_head.weight" in saved) == (case == "lfm2_bias_untied")  # tied: not saved
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k in saved or "expert" in k}
    if case == "lfm2_moe":
        assert "model.layers.4.feed_forward.experts.gate_up_proj" in state
        runner = load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "tf5", state))))
        close(runner_logits(runner, IDS), hf_logits(hf, IDS))
    del saved[removed]
    name = removed.split(".", 1)[1].replace(".", r"\.")
    with pytest.raises(ValueError, match=f"'{name}' is missing"):
        load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "missing", saved))))


@pytest.mark.parametrize("case", ["lfm2", "lfm2_moe"])
def test_engine_greedy_next_turn_and_drafts_match_transformers(case, tmp_path, monkeypatch):
    """``check_engine_turns``: chunks, mixed batches, a next turn restored from a
    checkpoint of the convolution states, drafts verified."""
    check_engine_turns(random_model(case, 49152), tmp_path, 49152, monkeypatch)


def test_bfloat16_stays_close_to_fp32(root):
    """bf16 weights and convolution states: the greedy tokens mostly fp32's."""
    _, path = checkpoint("lfm2_moe", root)
    bf16 = load_cpu_runner(ModelConfig(model=str(path), max_model_len=128, dtype="bfloat16"))
    assert bf16.model.layers[0].conv.in_proj.weight.dtype == torch.bfloat16
    assert bf16.model.recurrent_state_specs(torch.float32)[0][0].dtype == torch.bfloat16
    ours, fp32 = runner_logits(bf16, IDS), runner_logits(runner_for(path), IDS)
    assert (ours.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8
    assert (ours - fp32).abs().mean() <= 0.1 * fp32.abs().mean()
