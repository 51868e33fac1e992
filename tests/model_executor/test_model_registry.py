"""The model registry: HF ``architectures`` (or ``model_type``) -> our model class.

The four registered architectures share the Llama implementation; each is checked end to
end on a tiny random checkpoint written by transformers itself: loaded through the
registry and the runner's loader, our logits equal transformers' at every position.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import TINY_LLAMA, load_cpu_runner
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.registry import ModelRegistry

ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture
def registry(monkeypatch):
    """ModelRegistry with its table restored after the test."""
    monkeypatch.setattr(ModelRegistry, "models", dict(ModelRegistry.models))
    return ModelRegistry


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_family_resolves_to_the_llama_implementation(arch):
    cls, chosen = ModelRegistry.resolve_model_cls(SimpleNamespace(architectures=[arch]))
    assert cls is LlamaForCausalLM and chosen == arch


def test_model_type_is_the_fallback_when_no_architecture_is_listed():
    config = SimpleNamespace(architectures=None, model_type="qwen3")
    assert ModelRegistry.resolve_model_cls(config) == (LlamaForCausalLM, "Qwen3ForCausalLM")


def test_first_registered_architecture_wins():
    config = SimpleNamespace(architectures=["FancyForCausalLM", "MistralForCausalLM"])
    assert ModelRegistry.resolve_model_cls(config)[1] == "MistralForCausalLM"


def test_unknown_architecture_is_named_with_the_supported_ones():
    config = SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError) as e:
        ModelRegistry.resolve_model_cls(config)
    message = str(e.value)
    assert "GPT2LMHeadModel is not supported" in message
    assert all(arch in message for arch in ARCHS)
    # A listed but unknown architecture is not rescued by a known model_type.
    with pytest.raises(ValueError, match="LlamaForTokenClassification"):
        ModelRegistry.resolve_model_cls(
            SimpleNamespace(architectures=["LlamaForTokenClassification"], model_type="llama")
        )
    with pytest.raises(ValueError, match="none listed; model_type 'gpt2'"):
        ModelRegistry.resolve_model_cls(SimpleNamespace(architectures=[], model_type="gpt2"))


def test_registered_architecture_is_imported_lazily(registry):
    registry.register_model("ToyForCausalLM", "collections:OrderedDict", model_type="toy")
    assert "ToyForCausalLM" in registry.get_supported_archs()
    config = SimpleNamespace(architectures=None, model_type="toy")
    from collections import OrderedDict

    assert registry.resolve_model_cls(config) == (OrderedDict, "ToyForCausalLM")
    with pytest.raises(ValueError, match="module:Class"):
        registry.register_model("BadForCausalLM", "no_colon_here")
    registry.register_model("MissingForCausalLM", "vllm.no_such_module:Missing")
    with pytest.raises(ModuleNotFoundError):
        registry.resolve_model_cls(SimpleNamespace(architectures=["MissingForCausalLM"]))


# -- each registered architecture, end to end on a tiny checkpoint ----------------------------
TINY = TINY_LLAMA


def _tiny_checkpoint(arch: str, path) -> torch.nn.Module:
    import transformers

    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config_cls(**TINY)).eval()
    model.save_pretrained(path)
    return model


def assert_logits_match(runner, hf) -> None:
    """The runner's logits over 20 random tokens equal transformers' ``hf`` (atol 1e-4)."""
    runner.initialize_kv_cache(4)
    ids = torch.randint(0, TINY["vocab_size"], (20,), generator=torch.Generator().manual_seed(1))
    meta = runner.attn_backend.build_metadata([(0, len(ids), [1, 2])])
    with torch.inference_mode():
        ours = runner.model.compute_logits(
            runner.model(ids, torch.arange(len(ids)), meta, runner.kv_caches)
        )
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_registered_architecture_loads_and_matches_transformers(arch, tmp_path):
    from vllm.config import ModelConfig

    hf = _tiny_checkpoint(arch, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path)))
    assert type(runner.model) is LlamaForCausalLM
    assert (runner.arch.attention_bias, runner.arch.qk_norm) == (
        arch == "Qwen2ForCausalLM",
        arch == "Qwen3ForCausalLM",
    )
    assert_logits_match(runner, hf)


def test_phi3_checkpoints_with_fused_projections_match_transformers(tmp_path):
    """Phi-3/Phi-4: q/k/v and gate/up fused in the checkpoint, read as they are."""
    import transformers

    from vllm.config import ModelConfig
    from vllm.model_executor.models.llama import Phi3ForCausalLM

    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY, pad_token_id=0)).eval()
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path)))
    assert type(runner.model) is Phi3ForCausalLM
    assert_logits_match(runner, hf)
    # Phi-4-mini's partial rotary is read (its logits: test_rope_scaling.py).
    arch = Phi3ForCausalLM.arch_from_hf(
        transformers.Phi3Config(**TINY, pad_token_id=0, partial_rotary_factor=0.75)
    )
    assert arch.rope["partial_rotary_factor"] == 0.75


@pytest.mark.parametrize(
    "arch, fields",
    [
        # Granite's four scalars, none of them 1.
        ("Granite", dict(embedding_multiplier=12.0, attention_multiplier=0.1,
                         residual_multiplier=0.22, logits_scaling=8.0)),
        ("Granite", dict(attention_bias=True, attention_multiplier=0.2)),
        # Llama's attention_bias covers o_proj too (Qwen2's covers q/k/v only).
        ("Llama", dict(attention_bias=True)),
    ],
)  # fmt: skip
def test_granite_scalars_and_attention_biases_match_transformers(arch, fields, tmp_path):
    import transformers

    from vllm.config import ModelConfig

    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**TINY, **fields)
    hf = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    with torch.no_grad():  # transformers initialises biases to zero: make them count
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path)))
    assert_logits_match(runner, hf)


def test_mlp_biases_are_refused():
    import transformers

    with pytest.raises(ValueError, match="mlp_bias is not supported"):
        LlamaForCausalLM.arch_from_hf(transformers.LlamaConfig(**TINY, mlp_bias=True))
