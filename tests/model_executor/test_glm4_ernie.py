"""GLM-4 (``Glm4ForCausalLM``), ERNIE 4.5 (``Ernie4_5ForCausalLM``) and ERNIE-4.5-MoE
(``Ernie4_5_MoeForCausalLM``) through the Llama implementation's flags and the MoE
block (``models/llama.py``, ``models/moe.py``): GLM-4's GPT-J-style rotation of half of
each head, its sandwich norms, fused gate/up and q/k/v biases; ERNIE's GPT-J-style
rotation and tied head; ERNIE-MoE's dense layers outside its start/end/interval, its
softmax routing whose correction bias (``moe_statics``) changes the experts chosen, its
shared experts. Tiny checkpoints written by transformers give its logits, each flag is
live, and the engine's greedy tokens equal transformers' ``generate``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from tests.tiny_models import (
    TINY_LLAMA,
    check_engine_greedy_matches,
    load_cpu_runner,
    perturbed,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.layers.fused_moe import select_experts_grouped
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.moe import MoeForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

# Over TINY_LLAMA's fields. GLM-4: partial_rotary_factor 0.5 (its config's default), q/k/v
# biases; ERNIE: its head tied; ERNIE-MoE: experts in layers 1 and 3 of 4 (start 1,
# interval 2), a shared expert.
FAMILIES = {
    "Glm4ForCausalLM": dict(head_dim=16, attention_bias=True),
    "Ernie4_5ForCausalLM": dict(head_dim=16, tie_word_embeddings=True),
    "Ernie4_5_MoeForCausalLM": dict(head_dim=16, tie_word_embeddings=True, num_hidden_layers=4,
                                    moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                                    moe_num_shared_experts=1, moe_layer_start_index=1,
                                    moe_layer_interval=2),
}  # fmt: skip


def config_of(arch: str, **overrides):
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return config_cls(**{**TINY_LLAMA, "pad_token_id": 0, **FAMILIES[arch], **overrides})


def save(arch: str, path, **overrides) -> torch.nn.Module:
    """A random checkpoint (seed 0), norms away from 1 and biases from 0; ERNIE-MoE's
    router sharpened and its correction bias small, so that the scores and the bias both
    decide the experts."""
    torch.manual_seed(0)
    hf = perturbed(getattr(transformers, arch)(config_of(arch, **overrides)))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)
    hf.save_pretrained(path)
    return hf


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def tiny_ids(n: int = 100) -> torch.Tensor:
    return torch.randint(
        0, TINY_LLAMA["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)
    )


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_logits_equal_transformers(arch, tmp_path):
    hf = save(arch, tmp_path)
    moe = "Moe" in arch
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is (
        MoeForCausalLM if moe else LlamaForCausalLM
    )
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a, model = runner.arch, runner.model
    glm = arch.startswith("Glm")
    assert a.rope_interleaved and a.sandwich_norms == glm
    assert a.attention_bias == glm and not a.o_bias
    assert a.tie_word_embeddings == (not glm)
    assert a.rope["partial_rotary_factor"] == (0.5 if glm else 1.0)
    if moe:
        assert a.sparse_layers == (1, 3) and a.scoring == "softmax_biased"
        assert [layer.mlp is not None for layer in model.layers] == [False, True, False, True]
    ids = tiny_ids()
    ours, ref = runner_logits(runner, ids), hf_logits(hf, ids)
    assert ref.abs().mean() > 0.05
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_ernie_moe_bias_changes_the_choice(tmp_path):
    """The correction bias moves some tokens (not all) to other experts than their scores
    alone, and the tokens reach every expert."""
    hf = save("Ernie4_5_MoeForCausalLM", tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a = runner.arch
    mlp = runner.model.layers[1].mlp
    x = torch.randn(200, a.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        logits = mlp.gate(x)
        _, biased = select_experts_grouped(
            logits, mlp.e_score_correction_bias, 2, 1, 1, True, 1.0, "softmax"
        )
        _, plain = select_experts_grouped(logits, None, 2, 1, 1, True, 1.0, "softmax")
    changed = (biased.sort(-1).values != plain.sort(-1).values).any(-1).float().mean()
    assert 0.05 < changed < 0.95, changed
    assert biased.unique().numel() == a.num_experts
    bias = hf.model.layers[1].mlp.gate.moe_statics.e_score_correction_bias
    assert torch.equal(mlp.e_score_correction_bias, bias.reshape(-1))


def ours_with(hf, arch, change: dict, fused_write: bool = False) -> torch.Tensor:
    """Our logits of ``tiny_ids(60)`` for ``hf``'s weights under its arch changed by
    ``change``; ``fused_write``: the layers told the backend leaves K/V to the rotary op."""
    from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

    cls = MoeForCausalLM if "Moe" in arch else LlamaForCausalLM
    a = dataclasses.replace(cls.arch_from_hf(hf.config), **change)
    model = cls(a)
    model.load_weights(hf.state_dict())
    backend = TorchSDPABackend(a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, "cpu", 16)
    model.set_attention_backend(backend)
    for layer in model.layers:
        layer.rope_writes_kv = fused_write
    caches = [torch.zeros(2, 9, 16, a.num_kv_heads, a.head_dim) for _ in model.layers]
    meta = backend.build_metadata([(0, 60, list(range(1, 9)))])
    with torch.inference_mode():
        return model.compute_logits(model(tiny_ids(60), torch.arange(60), meta, caches))


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_each_flag_is_live(arch, tmp_path):
    """Turning a flag off moves the logits away from transformers' (a model that ignored
    it would fail above); a backend that lets the rotary op write K/V (CUDA's fused
    kernel, Neox-only) is not used for the interleaved rotation."""
    hf = save(arch, tmp_path)
    ref = hf_logits(hf, tiny_ids(60))
    ours = ours_with(hf, arch, {}, fused_write=True)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    changes = [dict(rope_interleaved=False)]
    if arch.startswith("Glm"):
        changes += [dict(sandwich_norms=False), dict(attention_bias=False)]
    if "Moe" in arch:
        changes += [dict(scoring="softmax")]  # no correction bias
    for change in changes:
        assert (ours_with(hf, arch, change) - ref).abs().max() > 1e-3, change


def test_ernie_moe_layer_placement_follows_end_index():
    """``moe_layer_end_index`` bounds the sparse layers (inclusive), the interval counts
    layers from 1, and a config without experts is dense throughout."""
    from vllm.model_executor.models.moe import MoeArch

    arch = "Ernie4_5_MoeForCausalLM"
    config = config_of(arch, num_hidden_layers=6, moe_layer_end_index=4, moe_layer_interval=1)
    assert MoeArch.from_hf(config).sparse_layers == (1, 2, 3, 4)
    config = config_of(arch, num_hidden_layers=6, moe_layer_start_index=0, moe_layer_interval=3)
    assert MoeArch.from_hf(config).sparse_layers == (2, 5)
    assert MoeArch.from_hf(config_of(arch, moe_num_experts=0)).sparse_layers == ()


def test_use_bias_is_refused():
    with pytest.raises(ValueError, match="use_bias"):
        LlamaForCausalLM.arch_from_hf(config_of("Ernie4_5ForCausalLM", use_bias=True))


@pytest.mark.parametrize("arch", ["Glm4ForCausalLM", "Ernie4_5_MoeForCausalLM"])
def test_engine_greedy_tokens_equal_transformers_generate(arch, tmp_path):
    """Chunked prefill, batched decodes and a prefix hit (``check_engine_greedy_matches``)."""
    hf = save(arch, tmp_path, vocab_size=49152, max_position_embeddings=256)
    check_engine_greedy_matches(hf, tmp_path)
