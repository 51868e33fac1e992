"""Granite 4.0-H, Nemotron-H and Bamba (``models/mamba_hybrid.py``: Mamba2 layers,
``layers/mamba2.py``, with attention) against transformers on tiny random checkpoints:
prompt logits; a prompt fed in chunks and decodes over real recurrent pools and a real KV
cache; a step mixing a fresh prefill (its slot stale) with decodes of other sequences; the
checkpoint's tensors (the Hub's names and transformers 5's); and the engine's greedy
tokens, a job's next turn restored from a checkpoint of the states.

The checkpoints are perturbed so that each part shows: norms away from 1, biases from 0,
decays slow enough for a state to carry across chunks (``A_log``), ``D`` away from 1,
decisive routers, Granite's four multipliers away from 1, a low rotary theta, and
Nemotron-H's dt floor (``time_step_min``) above some of its dt values (without the clamp
its logits move by 0.07). Bamba's queries, keys and Mamba2 input projections are drawn
larger, so that its half rotation and its ``time_step_limit`` (0.1, 0.8), which clamps
some 40% of its first layer's dt values at either end, show (its logits move by 0.009
rotating whole heads, by 0.14 without the limit)."""

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
from vllm.model_executor.layers.mamba2 import ssd_chunk_scan, ssd_step
from vllm.model_executor.models import mamba_hybrid
from vllm.model_executor.models.registry import ModelRegistry

VOCAB = 96
MAMBA = dict(mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_head=24,
             mamba_d_conv=4, mamba_chunk_size=16)  # fmt: skip
GRANITE = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
               layer_types=["mamba", "attention", "mamba", "mamba"], num_hidden_layers=4,
               intermediate_size=20, shared_intermediate_size=24, num_experts_per_tok=2,
               embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
               logits_scaling=1.5, max_position_embeddings=128, **MAMBA)  # fmt: skip
NEMOTRON = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                layers_block_type=["mamba", "attention", "mlp", "mamba", "moe"],
                intermediate_size=40, mamba_num_heads=4, mamba_head_dim=24, n_groups=2,
                ssm_state_size=8, conv_kernel=4, chunk_size=16, n_routed_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16,
                moe_shared_expert_intermediate_size=24, n_group=2, topk_group=1,
                routed_scaling_factor=1.5, max_position_embeddings=128)  # fmt: skip
ROPE = {"rope_type": "default", "rope_theta": 100.0}
BAMBA = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
             attn_layer_indices=[1, 3], intermediate_size=40, mamba_n_heads=4, mamba_n_groups=2,
             mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16, max_position_embeddings=128,
             rope_parameters=ROPE, time_step_limit=(0.1, 0.8), attention_bias=True,
             mlp_bias=True, mamba_proj_bias=True)  # fmt: skip
# name: (transformers class, its config's class and fields): 4 experts (top 2), unrotated;
# dense, rotated, tied; every kind of Nemotron-H layer; its experts through a latent
# projection, and the MLPs' and Mamba2 projections' biases; Bamba with every bias.
CASES = {
    "granite_moe": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                    dict(GRANITE, num_local_experts=4, tie_word_embeddings=False)),
    "granite_dense_rope": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                           dict(GRANITE, num_local_experts=0, position_embedding_type="rope",
                                rope_parameters=ROPE, tie_word_embeddings=True)),
    "nemotron_h": ("NemotronHForCausalLM", "NemotronHConfig",
                   dict(NEMOTRON, time_step_min=0.3)),
    "nemotron_h_latent_biases": ("NemotronHForCausalLM", "NemotronHConfig",
                                 dict(NEMOTRON, moe_latent_size=32, mlp_bias=True,
                                      use_bias=True)),
    "bamba": ("BambaForCausalLM", "BambaConfig", BAMBA),
}  # fmt: skip
SHARP = ("bamba",)  # cases whose q, k and Mamba2 in_proj are drawn larger (docstring)
IDS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1))


def make_config(case: str, vocab: int = VOCAB, **overrides):
    _, config, fields = CASES[case]
    return getattr(transformers, config)(vocab_size=vocab, **{**fields, **overrides})


def random_model(case: str, vocab: int = VOCAB, **overrides) -> torch.nn.Module:
    """transformers' model of ``case`` (its config's fields ``overrides``), seed 0,
    perturbed (module docstring)."""
    torch.manual_seed(0)
    hf = perturbed(getattr(transformers, CASES[case][0])(make_config(case, vocab, **overrides)))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):  # decays of 0.01 to 0.2 a token
                p.uniform_(-4.0, -1.5)
            elif name.endswith(".D"):
                p.normal_(0.0, 1.0)
            elif name.endswith(("router.weight", "gate.weight")):
                p.normal_(0.0, 0.3)
            elif case in SHARP and name.endswith(("in_proj.weight", "q_proj.weight",
                                                  "k_proj.weight")):  # fmt: skip
                p.normal_(0.0, 0.15)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
        hf.lm_head.weight.normal_(0.0, 0.3)
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
    return tmp_path_factory.mktemp("mamba_hybrid")


@pytest.mark.parametrize("case", CASES)
def test_prompt_logits_equal_transformers(case, root):
    hf, path = checkpoint(case, root)
    runner = runner_for(path)
    arch = CASES[case][0]
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is getattr(mamba_hybrid, arch)
    ref = hf_logits(hf, IDS)
    assert ref.std() > 0.3
    close(runner_logits(runner, IDS), ref)


def test_arch_and_state_specs(root):
    """The KV cache's layers are the attention ones; each Mamba2 layer declares its
    convolution's last 3 inputs of x, B, C and its (heads, head_dim, state) state; the
    Hub's spellings of the layers' kinds read as transformers 5's."""
    model = runner_for(checkpoint("nemotron_h", root)[1]).model
    a = model.arch
    assert (a.num_layers, a.num_heads, a.num_kv_heads, a.head_dim) == (1, 4, 2, 16)
    assert a.layer_types == ("mamba", "attention", "mlp", "mamba", "moe") and a.rope is None
    assert a.mamba.dt_limit == (0.3, math.inf) and not a.tie_word_embeddings
    specs = model.recurrent_state_specs(torch.bfloat16)
    assert len(specs) == 2
    assert [(s.shape, s.dtype) for s in specs[0]] == [
        ((96 + 2 * 2 * 8, 3), torch.float32), ((4, 24, 8), torch.bfloat16)
    ]  # fmt: skip
    pattern = transformers.NemotronHConfig(**{**NEMOTRON, "layers_block_type": None},
                                           hybrid_override_pattern="M*-ME")  # fmt: skip
    assert mamba_hybrid.nemotron_h_arch(pattern).layer_types == a.layer_types
    granite = mamba_hybrid.granite_arch(make_config("granite_dense_rope"))
    assert granite.layer_types == ("mamba", "attention", "mamba", "mamba")
    assert granite.rope["rope_theta"] == 100.0 and granite.num_experts == 0
    config = make_config("granite_moe", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        mamba_hybrid.granite_arch(config)


def test_chunk_scan_equals_transformers_and_the_step():
    """Three chunks (the last short) from a state, dt clamped: transformers' chunked scan,
    and the single-token update applied token by token."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        mamba2_chunk_scan as reference,
    )

    g = torch.Generator().manual_seed(0)
    t, h, p, n, groups = 37, 4, 6, 5, 2
    x = torch.randn(t, h, p, generator=g)
    dt_raw, dt_bias = torch.randn(t, h, generator=g), torch.randn(h, generator=g)
    a, d = -torch.rand(h, generator=g), torch.randn(h, generator=g)
    b, c = (torch.randn(t, groups, n, generator=g) for _ in range(2))
    state = torch.randn(h, p, n, generator=g)
    ref, ref_state = reference(x[None], dt_raw[None], a, b[None], c[None], chunk_size=16, D=d,
                               dt_bias=dt_bias, initial_states=state[None], dt_softplus=True,
                               dt_limit=(0.3, 10.0), return_final_states=True)  # fmt: skip
    dt = torch.nn.functional.softplus(dt_raw + dt_bias).clamp(0.3, 10.0)
    assert (dt == 0.3).any()
    bh, ch = (z.repeat_interleave(2, dim=1) for z in (b, c))
    y, final = ssd_chunk_scan(x, dt, a, bh, ch, state, chunk_size=16)
    close(y + d[:, None] * x, ref[0])
    close(final, ref_state[0])
    s, steps = state[None], []
    for i in range(t):
        out, s = ssd_step(x[i : i + 1], dt[i : i + 1], a, bh[i : i + 1], ch[i : i + 1], s)
        steps.append(out)
    close(torch.cat(steps), y)
    close(s[0], final)


@pytest.mark.parametrize("case", ["granite_moe", "nemotron_h", "bamba"])
def test_chunks_and_decodes_continue_the_prompt(case, root):
    """2 + 11 + 1 + 23 tokens (the first chunk shorter than the convolution's state, a
    one-token chunk through the decode update, the last over two scan chunks of 16), then
    3 decodes, in slot 2 of 4: each step's last row is the whole forward's row."""
    hf, path = checkpoint(case, root)
    check_chunks_continue(runner_for(path), IDS, (2, 11, 1, 23, 1, 1, 1))


@pytest.mark.parametrize("case", ["granite_moe", "nemotron_h", "bamba"])
def test_mixed_step_equals_each_sequence_alone(case, root):
    """One step of [decode of b, a fresh 11-token prompt a, decode of c], a's slot holding a
    stale state; then a decode-only step of all three in another order: every row equals
    transformers' logits of its sequence alone."""
    hf, path = checkpoint(case, root)
    check_mixed_step(hf, runner_for(path), VOCAB)


@pytest.mark.parametrize(
    "case, removed",
    [("granite_moe", "model.layers.2.mamba.D"),
     ("nemotron_h", "backbone.layers.4.mixer.experts.3.up_proj.weight")],
)  # fmt: skip
def test_transformers_names_load_and_a_missing_tensor_is_named(case, removed, root, tmp_path):
    """The tensors as transformers 5 holds them (``model.``; experts stacked, Granite's
    router as ``router.weight``) load to the same logits; a checkpoint without one of its
    tensors fails naming it."""
    hf, path = checkpoint(case, root)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(".experts.gate_up_proj" in k or ".experts.up_proj" in k for k in state)
    runner = load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "tf5", state))))
    close(runner_logits(runner, IDS), hf_logits(hf, IDS))
    missing = load_file(path / "model.safetensors")
    del missing[removed]
    name = removed.split(".", 1)[1].replace(".", r"\.")
    with pytest.raises(ValueError, match=f"'{name}' is missing"):
        load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "missing", missing))))


@pytest.mark.parametrize("case", ["granite_moe", "nemotron_h", "bamba"])
def test_engine_greedy_next_turn_and_drafts_match_transformers(case, tmp_path, monkeypatch):
    """``check_engine_turns``: chunks, mixed batches, a next turn restored from a
    checkpoint of the Mamba2 states, drafts verified."""
    # transformers' decode step leaves dt unclamped: Nemotron-H's default floor, under
    # every dt here, and Bamba without its limit keep its prefill and its decodes alike
    unclamped = {"nemotron_h": {"time_step_min": 0.001},
                 "bamba": {"time_step_limit": (0.0, math.inf)}}  # fmt: skip
    hf = random_model(case, 49152, **unclamped.get(case, {}))
    check_engine_turns(hf, tmp_path, 49152, monkeypatch)


def test_bamba_arch_and_a_missing_tensor_is_named(root, tmp_path):
    """Attention at ``attn_layer_indices`` (the KV cache's 2 layers), the first half of
    each head rotated, dt clamped to ``time_step_limit``; a checkpoint without one of its
    tensors fails naming it."""
    path = checkpoint("bamba", root)[1]
    a = runner_for(path).model.arch
    assert a.layer_types == ("mamba", "attention") * 2 and (a.num_layers, a.head_dim) == (2, 12)
    assert a.rope["partial_rotary_factor"] == 0.5 and a.mamba.dt_limit == (0.1, 0.8)
    assert math.isclose(a.attention_scale, 12**-0.5) and a.mamba.proj_bias and a.mlp_bias
    missing = load_file(path / "model.safetensors")
    del missing["model.layers.3.feed_forward.up_proj.bias"]
    with pytest.raises(ValueError, match=r"'layers\.3\.feed_forward\.up_proj\.bias' is missing"):
        load_cpu_runner(ModelConfig(model=str(resaved(path, tmp_path / "missing", missing))))


@pytest.mark.parametrize("case", ["granite_moe", "nemotron_h"])
def test_bfloat16_stays_close_to_fp32(case, root):
    """bf16 weights and conv states (the SSM state in the dtype asked for), the scan in
    fp32: the greedy tokens mostly fp32's."""
    hf, path = checkpoint(case, root)
    bf16 = load_cpu_runner(ModelConfig(model=str(path), max_model_len=128, dtype="bfloat16"))
    assert bf16.model.layers[0].mixer.in_proj.weight.dtype == torch.bfloat16
    specs = bf16.model.recurrent_state_specs(torch.float32)[0]
    assert (specs[0].dtype, specs[1].dtype) == (torch.bfloat16, torch.float32)
    ours, fp32 = runner_logits(bf16, IDS), runner_logits(runner_for(path), IDS)
    assert (ours.argmax(-1) == fp32.argmax(-1)).float().mean() >= 0.8
    assert (ours - fp32).abs().mean() <= 0.1 * fp32.abs().mean()
