"""MiniMax-M2 (``MiniMaxM2ForCausalLM``: M2, M2.1, M2.5), served by ``models/moe.py``: q and k
RMS-normalised over the whole projection, half of each head rotated (neox halves), a
sigmoid router whose correction bias moves the choice and not the weights. Tiny
checkpoints written by transformers (what ``save_pretrained`` writes: the Hub's per-expert
names; transformers 5's own stacked experts; the Hub's config.json with its MTP modules'
tensors; block FP8) give transformers' logits; the engine's greedy tokens equal its
``generate``; configs computed otherwise are refused."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.tiny_models import (
    TINY_LLAMA,
    check_engine_greedy_matches,
    load_cpu_runner,
    perturbed,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.layers.fused_moe import select_experts_grouped
from vllm.model_executor.models import moe
from vllm.model_executor.models.moe import MoeForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

# 16-wide heads of which 8 dimensions rotate (rotary_dim, as the Hub's configs name it; a
# low theta so that the rotation shows in 100 positions), 8 experts, 2 a token.
TINY_M2 = dict(TINY_LLAMA, intermediate_size=32, head_dim=16, rotary_dim=8, rope_theta=1000.0,
               num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
# The fields of the released config.json that transformers' config class does not declare.
HUB_FIELDS = dict(use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid",
                  shared_intermediate_size=0, use_routing_bias=True, num_mtp_modules=3,
                  mtp_transformer_layers=1, use_mtp=True)  # fmt: skip
IDS = torch.randint(0, TINY_LLAMA["vocab_size"], (100,), generator=torch.Generator().manual_seed(1))


def m2_config(**overrides) -> transformers.MiniMaxM2Config:
    return transformers.MiniMaxM2Config(**{**TINY_M2, **overrides})


def make_hf(**overrides) -> torch.nn.Module:
    """A random tiny MiniMax-M2 (seed 0) scaled so that everything shows: norms' weights
    away from 1, router logits of order 1 (the sigmoid's scores spread), experts large
    enough to move the logits, correction biases that change some tokens' choice, logits of
    order 1."""
    torch.manual_seed(0)
    hf = perturbed(transformers.MiniMaxM2ForCausalLM(m2_config(**overrides)))
    with torch.no_grad():
        hf.lm_head.weight.normal_(0.0, 0.1)
        for layer in hf.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.3)
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.15)
            layer.mlp.experts.down_proj.normal_(0.0, 0.15)
            layer.mlp.e_score_correction_bias.normal_(0.0, 0.1)
    return hf


def hf_logits(hf, ids=IDS) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def fp32_runner(path):
    return load_cpu_runner(ModelConfig(model=str(path), max_model_len=128))


def test_minimax_m2_resolves_to_the_moe_implementation_with_its_attention_and_router():
    config = m2_config(**HUB_FIELDS)
    assert ModelRegistry.resolve_model_cls(config)[0] is MoeForCausalLM
    a = MoeForCausalLM.arch_from_hf(config)
    assert (a.qk_norm, a.qk_norm_full) == (False, True)  # not Qwen3's per-head norms
    assert a.rope["partial_rotary_factor"] == 0.5 and a.rope_theta == 1000.0
    assert (a.scoring, a.num_groups, a.routed_scaling_factor, a.norm_topk_prob) == (
        "sigmoid", 1, 1.0, True
    )  # fmt: skip
    assert a.shared_expert_intermediate_size == 0 and a.sparse_layers == (0, 1)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size) == (8, 2, 32)
    assert a.checkpoint_prefix == "block_sparse_moe" and a.routing_bias
    # transformers attends over the whole context whatever the config's window
    assert MoeForCausalLM.arch_from_hf(m2_config(sliding_window=8)).sliding_windows == ()


def save_stacked(hf, path) -> None:
    """transformers 5's own names (the state dict as the model holds it): the experts
    stacked in ``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.e_score_correction_bias``."""
    hf.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              path / "model.safetensors", metadata={"format": "pt"})  # fmt: skip


@pytest.mark.parametrize("layout", ["save_pretrained", "stacked"])
def test_fp32_logits_equal_transformers(layout, tmp_path):
    hf = make_hf()
    if layout == "stacked":
        save_stacked(hf, tmp_path)
        names = load_file(tmp_path / "model.safetensors")
        assert "model.layers.0.mlp.experts.gate_up_proj" in names
    else:  # the Hub's per-expert names, as transformers writes them back
        hf.save_pretrained(tmp_path)
        names = load_file(tmp_path / "model.safetensors")
        for n in ("experts.7.w1.weight", "experts.7.w2.weight", "experts.7.w3.weight",
                  "gate.weight", "e_score_correction_bias"):  # fmt: skip
            assert f"model.layers.1.block_sparse_moe.{n}" in names
    assert names["model.layers.0.self_attn.q_norm.weight"].shape == (64,)  # 4 heads * 16
    assert names["model.layers.0.self_attn.k_norm.weight"].shape == (32,)  # 2 heads * 16
    ours = runner_logits(fp32_runner(tmp_path), IDS)
    ref = hf_logits(hf)
    assert ref.std() > 0.3
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_hub_config_and_mtp_tensors_load_to_the_same_logits(tmp_path):
    """The released config.json's fields (``rotary_dim`` and ``rope_theta`` for the rotation,
    no ``rope_parameters``; ``num_mtp_modules``...) and the MTP modules' tensors past the
    decoder layers (``model.layers.{num_hidden_layers + i}.``), which are not read."""
    hf = make_hf()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(HUB_FIELDS, rope_theta=1000.0, rotary_dim=8, attn_type_list=[1, 1])
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(tmp_path / "model.safetensors")
    for name in [n for n in state if n.startswith("model.layers.1.")]:
        state[name.replace("layers.1.", "layers.2.")] = torch.randn(state[name].shape)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    runner = fp32_runner(tmp_path)
    assert runner.arch.rope["partial_rotary_factor"] == 0.5 and len(runner.model.layers) == 2
    ours = runner_logits(runner, IDS)
    assert torch.allclose(ours, hf_logits(hf), atol=1e-4), (ours - hf_logits(hf)).abs().max()


def test_bfloat16_logits_near_transformers(tmp_path):
    hf = make_hf()
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128, dtype="bfloat16"))
    assert runner.model.layers[0].mlp.e_score_correction_bias.dtype == torch.bfloat16
    ours = runner_logits(runner, IDS)
    ref = hf_logits(
        transformers.MiniMaxM2ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    )
    fp32 = hf_logits(hf)
    # bf16 rounding (a token whose bf16 rounding flips a close routing choice moves more)
    assert (ours - ref).abs().mean() <= 0.05 * ref.abs().mean()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (ours - fp32).abs().mean() <= 0.05 * fp32.abs().mean()


def ignoring_the_bias(logits, bias, *rest):
    return select_experts_grouped(logits, torch.zeros_like(bias), *rest)


def weighting_by_the_biased_scores(logits, bias, *rest):
    _, ids = select_experts_grouped(logits, bias, *rest)
    weights = (logits.float().sigmoid() + bias.float()).gather(1, ids)
    return weights / weights.sum(-1, keepdim=True), ids


def test_the_routing_bias_changes_the_choice_and_not_the_weights(tmp_path, monkeypatch):
    """A model that ignores the correction bias, or that weights the experts by the biased
    scores, is off transformers' logits; the bias changes some tokens' experts, not all."""
    hf = make_hf()
    hf.save_pretrained(tmp_path)
    runner = fp32_runner(tmp_path)
    ref = hf_logits(hf)
    assert torch.allclose(runner_logits(runner, IDS), ref, atol=1e-4)
    block = runner.model.layers[0].mlp
    x = torch.randn(200, TINY_LLAMA["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        router = block.gate(x)
    _, biased = select_experts_grouped(router, block.e_score_correction_bias, 2, 1, 1, True, 1.0)
    _, plain = select_experts_grouped(router, torch.zeros(8), 2, 1, 1, True, 1.0)
    moved = (biased.sort(-1).values != plain.sort(-1).values).any(-1).float().mean()
    assert 0.1 < moved < 0.9, moved
    for wrong in (ignoring_the_bias, weighting_by_the_biased_scores):
        monkeypatch.setattr(moe, "select_experts_grouped", wrong)
        assert (runner_logits(runner, IDS) - ref).abs().max() > 1e-2, wrong.__name__


def test_without_use_routing_bias_the_missing_bias_is_zero(tmp_path):
    hf = make_hf(use_routing_bias=False)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.e_score_correction_bias.zero_()  # transformers' init where none loads
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state = {k: v for k, v in state.items() if not k.endswith("e_score_correction_bias")}
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    runner = fp32_runner(tmp_path)
    assert not runner.arch.routing_bias
    assert torch.allclose(runner_logits(runner, IDS), hf_logits(hf), atol=1e-4)
    (tmp_path / "config.json").write_text(
        json.dumps({**json.loads((tmp_path / "config.json").read_text()), "use_routing_bias": True})
    )
    with pytest.raises(KeyError, match="e_score_correction_bias"):
        fp32_runner(tmp_path)


def test_block_fp8_checkpoint_equals_its_dequantized_weights(tmp_path):
    """The released checkpoints' format (``quant_method: fp8``, block scales; the routers
    and correction biases left unquantized), dequantized on the CPU."""
    from tests.model_executor.fp8_checkpoints import write_fp8_checkpoint

    reference = write_fp8_checkpoint(make_hf(), tmp_path, "fp8_block", (32, 32))
    state = load_file(tmp_path / "model.safetensors")
    assert state["model.layers.0.block_sparse_moe.experts.3.w2.weight"].dtype == torch.float8_e4m3fn
    assert state["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32
    ours = runner_logits(fp32_runner(tmp_path), IDS)
    ref = hf_logits(reference)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize(
    "field, value",
    [("use_qk_norm", False), ("qk_norm_type", "per_head"), ("scoring_func", "softmax"),
     ("shared_intermediate_size", 64), ("attn_type_list", [0, 1]), ("hidden_act", "gelu")],
)  # fmt: skip
def test_configs_computed_otherwise_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        MoeForCausalLM.arch_from_hf(m2_config(**{**HUB_FIELDS, field: value}))


def test_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """The engine (chunked prefill, a batch of decodes, a prefix hit) on a MiniMax-M2
    checkpoint with the embedded model's tokenizer: transformers' greedy tokens."""
    hf = make_hf(vocab_size=49152, max_position_embeddings=256)
    hf.save_pretrained(tmp_path)
    check_engine_greedy_matches(hf, tmp_path)
