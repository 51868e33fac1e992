"""Mamba, FalconMamba, Mamba2 and Jamba (``models/mamba.py``; Mamba1 mixer in
``layers/mamba1.py``) against transformers on tiny random checkpoints: prompt logits; a
prompt fed in chunks and decodes over real recurrent pools; a step mixing a fresh prefill
with decodes; the engine's greedy tokens with a prefix hit and drafts; the arch and state
shapes, refused options, a missing tensor named.

The pure models have no attention layer (no KV tensor: the runner's blocks count tokens
only). Norms and biases are perturbed away from 1 and 0 (FalconMamba's B/C/dt norms have
no weight; Jamba's do), ``D`` away from 1, the projections large enough for dt, B and C to
matter; Jamba has experts on a Mamba layer and on an attention layer."""

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
from vllm.model_executor.models import mamba
from vllm.model_executor.models.registry import ModelRegistry

VOCAB = 96
MAMBA1 = dict(hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4,
              time_step_rank=4)  # fmt: skip
CASES = {
    "mamba": (transformers.MambaConfig, transformers.MambaForCausalLM,
              dict(MAMBA1, use_bias=True, tie_word_embeddings=False)),
    "falcon_mamba": (transformers.FalconMambaConfig, transformers.FalconMambaForCausalLM,
                     dict(MAMBA1, mixer_rms_eps=1e-3, tie_word_embeddings=True)),
    "mamba2": (transformers.Mamba2Config, transformers.Mamba2ForCausalLM,
               dict(hidden_size=32, num_heads=4, head_dim=16, n_groups=2, state_size=8,
                    num_hidden_layers=2, chunk_size=16, use_bias=True,
                    tie_word_embeddings=False)),
    "jamba": (transformers.JambaConfig, transformers.JambaForCausalLM,
              dict(hidden_size=32, intermediate_size=24, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
                   attn_layer_offset=1, expert_layer_period=3, expert_layer_offset=0,
                   num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                   mamba_proj_bias=True, max_position_embeddings=128,
                   tie_word_embeddings=False)),
}  # fmt: skip
CLASSES = {"mamba": "MambaForCausalLM", "falcon_mamba": "FalconMambaForCausalLM",
           "mamba2": "Mamba2ForCausalLM", "jamba": "JambaForCausalLM"}  # fmt: skip
IDS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))


def random_model(case: str, vocab: int = VOCAB, **changes):
    """transformers' model of ``case``, seed 0, perturbed (module docstring)."""
    config_cls, model_cls, fields = CASES[case]
    torch.manual_seed(0)
    hf = perturbed(model_cls(config_cls(vocab_size=vocab, **{**fields, **changes})))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)  # decays of about 0.3 to 4.5 a unit of dt
            elif name.endswith(".D"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("in_proj.weight", "x_proj.weight", "q_proj.weight",
                                "k_proj.weight")):  # fmt: skip
                p.normal_(0.0, 0.2)
            elif "feed_forward" in name and "norm" not in name:  # Jamba's MLPs and experts
                p.normal_(0.0, 0.15)
        hf.lm_head.weight.normal_(0.0, 0.3)
    return hf


@functools.cache
def checkpoint(case: str, root):
    hf = random_model(case)
    path = root / case
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mamba")


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_equal_transformers(case, root):
    hf, path = checkpoint(case, root)
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is getattr(mamba, CLASSES[case])
    ref = hf_logits(hf, IDS)
    assert ref.std() > 0.3
    close(runner_logits(runner_for(path), IDS), ref)


@pytest.mark.parametrize("case", CASES)
def test_chunks_and_decodes_continue_the_prompt(case, root):
    """2 + 11 + 1 + 23 tokens (a first chunk shorter than the convolution's state, a
    one-token chunk through the decode update, the last over two Mamba2 scan chunks),
    then 3 decodes, in slot 2 of 4: each step's last row is the whole forward's row."""
    check_chunks_continue(runner_for(checkpoint(case, root)[1]), IDS, (2, 11, 1, 23, 1, 1, 1))


@pytest.mark.parametrize("case", CASES)
def test_mixed_step_equals_each_sequence_alone(case, root):
    hf, path = checkpoint(case, root)
    check_mixed_step(hf, runner_for(path), VOCAB)


def test_arch_state_specs_and_kv_cache(root):
    """The pure models: no attention layer, no KV tensor, blocks still counted; Mamba1's
    states (intermediate, kernel - 1) and (intermediate, state); Jamba's layers."""
    runner = runner_for(checkpoint("mamba", root)[1])
    model = runner.model
    assert model.arch.num_layers == 0 and runner.kv_groups.num_tensors == 0
    assert runner.get_kv_cache_bytes_per_block() == 0 and runner.determine_num_blocks() > 1
    specs = model.recurrent_state_specs(torch.bfloat16)
    assert len(specs) == 2
    assert [(s.shape, s.dtype) for s in specs[0]] == [
        ((64, 3), torch.float32), ((64, 8), torch.bfloat16)
    ]  # fmt: skip
    m2 = runner_for(checkpoint("mamba2", root)[1]).model.recurrent_state_specs(torch.float32)
    assert [s.shape for s in m2[0]] == [(64 + 2 * 2 * 8, 3), (4, 16, 8)]
    jamba = runner_for(checkpoint("jamba", root)[1]).model
    a = jamba.arch
    assert a.layer_types == ("mamba", "attention", "mamba", "attention")
    assert (a.num_layers, a.num_mamba_layers, a.expert_layers) == (2, 2, frozenset({0, 3}))
    assert a.mamba.dt_rank == 2 and a.rope is None
    falcon = runner_for(checkpoint("falcon_mamba", root)[1]).model
    assert falcon.arch.tie_word_embeddings and falcon.arch.mixer.bcdt_eps == 1e-3
    for case in ("mamba", "mamba2", "jamba"):
        config_cls, _, fields = CASES[case]
        config = config_cls(vocab_size=VOCAB, **fields)
        config.hidden_act = "gelu"
        with pytest.raises(ValueError, match="hidden_act 'gelu'"):
            getattr(mamba, CLASSES[case]).arch_from_hf(config)


def test_missing_tensor_is_named_and_original_embedding_name(root, tmp_path):
    """The original checkpoints' ``backbone.embedding.weight`` loads as ``embeddings``; a
    missing tensor fails naming it."""
    hf, path = checkpoint("mamba", root)
    state = load_file(path / "model.safetensors")
    state["backbone.embedding.weight"] = state.pop("backbone.embeddings.weight")
    runner = load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "orig", state))))
    close(runner_logits(runner, IDS), hf_logits(hf, IDS))
    del state["backbone.layers.1.mixer.x_proj.weight"]
    with pytest.raises(ValueError, match=r"'layers\.1\.mixer\.x_proj\.weight' is "):
        load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "missing", state))))


def test_jamba_experts_stacked_as_transformers_5(root, tmp_path):
    """Jamba's experts stacked (``experts.gate_up_proj`` [gate; up], ``experts.down_proj``)
    load as the Hub's one by one do."""
    hf, path = checkpoint("jamba", root)
    state = load_file(path / "model.safetensors")
    for layer in (0, 3):
        p = f"model.layers.{layer}.feed_forward.experts."
        parts = {n: [state.pop(f"{p}{e}.{n}_proj.weight") for e in range(4)]
                 for n in ("gate", "up", "down")}  # fmt: skip
        state[p + "gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(parts["gate"], parts["up"], strict=True)]
        )
        state[p + "down_proj"] = torch.stack(parts["down"])
    runner = load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "stacked", state))))
    close(runner_logits(runner, IDS), hf_logits(hf, IDS))


@pytest.mark.parametrize("case", ["mamba", "mamba2", "jamba"])
def test_engine_greedy_next_turn_and_drafts_match_transformers(case, tmp_path, monkeypatch):
    """``check_engine_turns``: chunks, mixed batches, a next turn restored from a
    checkpoint of the states, drafts verified (the pure models with no KV tensor)."""
    check_engine_turns(random_model(case, 49152), tmp_path, 49152, monkeypatch)


def test_bfloat16_stays_close_to_fp32(root):
    """bf16 weights and conv states, the residual stream in fp32, the scan in fp32: the
    greedy tokens mostly fp32's."""
    path = checkpoint("falcon_mamba", root)[1]
    bf16 = load_cpu_runner(ModelConfig(model=str(path), max_model_len=128, dtype="bfloat16"))
    ours, fp32 = runner_logits(bf16, IDS), runner_logits(runner_for(path), IDS)
    assert (ours.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8
    assert (ours - fp32).abs().mean() <= 0.1 * fp32.abs().mean()
