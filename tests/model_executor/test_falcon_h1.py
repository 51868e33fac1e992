"""Falcon-H1 (``models/falcon_h1.py``: Mamba2 and attention side by side in every layer)
against transformers on tiny random checkpoints: prompt logits; each muP multiplier
exercised (transformers' logits move when it is reset to 1); a prompt fed in chunks and
decodes over real recurrent pools and a real KV cache; a step mixing a fresh prefill with
decodes; the checkpoint's tensor names; the engine's greedy tokens and a job's next turn.

Two configs: the released checkpoints' kind (no gated norm in the mixer, attention heads
narrower than ``hidden_size / heads``), and one with the mixer's gated RMS norm (after
the gate, over 2 groups), every bias and tied embeddings. Every multiplier is away from 1
and each its own value; the checkpoints are perturbed as ``test_mamba_hybrid``'s."""

from __future__ import annotations

import functools
import math

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
from vllm.model_executor.models import falcon_h1
from vllm.model_executor.models.registry import ModelRegistry

VOCAB = 96
MULTIPLIERS = dict(embedding_multiplier=2.0, lm_head_multiplier=0.6, key_multiplier=0.7,
                   attention_in_multiplier=1.3, attention_out_multiplier=0.8,
                   ssm_in_multiplier=1.25, ssm_out_multiplier=0.55,
                   ssm_multipliers=[0.5, 1.5, 0.75, 1.4, 0.9],
                   mlp_multipliers=[0.65, 1.2])  # fmt: skip
FALCON = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_hidden_layers=3, intermediate_size=40, mamba_d_ssm=64, mamba_n_heads=4,
              mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=16,
              max_position_embeddings=128,
              rope_parameters={"rope_type": "default", "rope_theta": 100.0},
              **MULTIPLIERS)  # fmt: skip
CASES = {
    "released": dict(FALCON, mamba_rms_norm=False, tie_word_embeddings=False),
    "norm_biases_tied": dict(FALCON, mamba_rms_norm=True, mamba_norm_before_gate=True,
                             mamba_proj_bias=True, projectors_bias=True, attention_bias=True,
                             mlp_bias=True, tie_word_embeddings=True),
}  # fmt: skip
IDS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))


def random_model(fields: dict, vocab: int = VOCAB) -> transformers.FalconH1ForCausalLM:
    """transformers' model of ``fields``, seed 0, perturbed: norms and biases away from 1
    and 0, decays of 0.01 to 0.2 a token (``A_log``), ``D`` away from 1, the Mamba2 input
    projections and the queries and keys large enough for every part of them to matter
    (scores away from uniform)."""
    torch.manual_seed(0)
    config = transformers.FalconH1Config(vocab_size=vocab, **fields)
    hf = perturbed(transformers.FalconH1ForCausalLM(config))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -1.5)
            elif name.endswith(".D"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("in_proj.weight", "q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.15)  # B . C, dt and q . k large enough to matter
        hf.lm_head.weight.normal_(0.0, 0.3)
    return hf


@functools.cache
def checkpoint(case: str, root) -> tuple[transformers.FalconH1ForCausalLM, object]:
    hf = random_model(CASES[case])
    path = root / case
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("falcon_h1")


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_equal_transformers(case, root):
    hf, path = checkpoint(case, root)
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is falcon_h1.FalconH1ForCausalLM
    ref = hf_logits(hf, IDS)
    assert ref.std() > 0.3
    close(runner_logits(runner_for(path), IDS), ref)


@pytest.mark.parametrize("case", CASES)
def test_every_multiplier_shows(case, root):
    """transformers' logits with any one multiplier (or one of ``ssm_multipliers``' five
    parts, ``mlp_multipliers``' two) put back to 1 move from ours by more than ten times
    the tolerance of the equality above (by 3e-3 to 3.5): that equality holds each."""
    hf, path = checkpoint(case, root)
    ours = runner_logits(runner_for(path), IDS)
    variants = [(name, 1.0) for name in MULTIPLIERS if not name.endswith("s")]
    for name in ("ssm_multipliers", "mlp_multipliers"):
        for k in range(len(MULTIPLIERS[name])):
            ones = list(MULTIPLIERS[name])
            ones[k] = 1.0
            variants.append((name, ones))
    for name, value in variants:
        config = transformers.FalconH1Config(**{**hf.config.to_dict(), name: value})
        reset = transformers.FalconH1ForCausalLM(config).eval()
        reset.load_state_dict(hf.state_dict())
        assert (hf_logits(reset, IDS) - ours).abs().max() > 1e-3, (name, value)


def test_arch_and_state_specs(root):
    """Every layer has a KV cache and Mamba2 states (the mixer's width ``mamba_d_ssm``);
    attention heads of ``head_dim``, rotated whole, scaled by the key multiplier too;
    the mixer without a norm weight in the released kind."""
    model = runner_for(checkpoint("released", root)[1]).model
    a = model.arch
    assert (a.num_layers, a.num_mamba_layers, a.num_heads, a.head_dim) == (3, 3, 4, 8)
    assert a.layer_types == ("parallel",) * 3
    assert a.rope["partial_rotary_factor"] == 1.0 and a.rope["rope_theta"] == 100.0
    assert math.isclose(a.attention_scale, 0.7 / math.sqrt(8))
    assert a.mamba.intermediate == 64
    assert a.mamba.zxbcdt_multipliers == (0.5, 1.5, 0.75, 1.4, 0.9)
    mixer = model.layers[0].mamba
    assert mixer.norm_weight is None and mixer.out_proj.bias is None
    # the computed muP vector: z and x (64 each), B and C (2 groups of 8 each), dt (4 heads)
    want = [0.5] * 64 + [1.5] * 64 + [0.75] * 16 + [1.4] * 16 + [0.9] * 4
    assert torch.equal(mixer.mup_vector, torch.tensor(want))
    specs = model.recurrent_state_specs(torch.bfloat16)
    assert len(specs) == 3
    assert [(s.shape, s.dtype) for s in specs[0]] == [
        ((64 + 2 * 2 * 8, 3), torch.float32), ((4, 16, 8), torch.bfloat16)
    ]  # fmt: skip
    normed = runner_for(checkpoint("norm_biases_tied", root)[1]).model
    assert normed.layers[0].mamba.out_proj.bias is not None and normed.arch.tie_word_embeddings
    gelu = transformers.FalconH1Config(**{**CASES["released"], "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        falcon_h1.falcon_h1_arch(gelu)


@pytest.mark.parametrize("case", CASES)
def test_chunks_and_decodes_continue_the_prompt(case, root):
    """2 + 11 + 1 + 23 tokens (a first chunk shorter than the convolution's state, a
    one-token chunk through the decode update, the last over two scan chunks), then 3
    decodes, in slot 2 of 4: each step's last row is the whole forward's row."""
    check_chunks_continue(runner_for(checkpoint(case, root)[1]), IDS, (2, 11, 1, 23, 1, 1, 1))


@pytest.mark.parametrize("case", CASES)
def test_mixed_step_equals_each_sequence_alone(case, root):
    """[decode of b, a fresh prompt a over a stale slot, decode of c], then a decode-only
    step of all three: every row is transformers' logits of its sequence alone."""
    hf, path = checkpoint(case, root)
    check_mixed_step(hf, runner_for(path), VOCAB)


def test_missing_tensor_is_named_and_mup_vector_is_not_read(root, tmp_path):
    """A checkpoint without one of its tensors fails naming it; a stray ``mup_vector`` in
    a checkpoint is ignored (transformers computes it from the config, as we do)."""
    hf, path = checkpoint("released", root)
    state = load_file(path / "model.safetensors")
    assert not any("mup_vector" in k for k in state)  # transformers does not save it
    stray = dict(state, **{"model.layers.0.mamba.mup_vector": torch.zeros(1, 1, 164)})
    runner = load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "stray", stray))))
    close(runner_logits(runner, IDS), hf_logits(hf, IDS))
    del state["model.layers.2.feed_forward.gate_proj.weight"]
    with pytest.raises(ValueError, match=r"'layers\.2\.feed_forward\.gate_proj\.weight' is "):
        load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "missing", state))))


def test_engine_greedy_next_turn_and_drafts_match_transformers(tmp_path, monkeypatch):
    """``check_engine_turns``: chunks, mixed batches, a next turn restored from a
    checkpoint of the Mamba2 states, drafts verified."""
    check_engine_turns(random_model(CASES["released"], 49152), tmp_path, 49152, monkeypatch)


def test_bfloat16_stays_close_to_fp32(root):
    """bf16 weights (the muP vector too) and conv states, the scan in fp32: the greedy
    tokens mostly fp32's."""
    path = checkpoint("released", root)[1]
    bf16 = load_cpu_runner(ModelConfig(model=str(path), max_model_len=128, dtype="bfloat16"))
    assert bf16.model.layers[0].mamba.mup_vector.dtype == torch.bfloat16
    ours, fp32 = runner_logits(bf16, IDS), runner_logits(runner_for(path), IDS)
    assert (ours.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8
    assert (ours - fp32).abs().mean() <= 0.1 * fp32.abs().mean()
