"""``--load-format dummy``: random weights from a folder holding only config.json and the
tokenizer, as vLLM's dummy loader (used by benchmarks and by the GPU study, where writing
and reading an 8B checkpoint per server costs minutes of a short device lease)."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from tests.tiny_models import TINY_LLAMA, save_tiny_llama
from vllm.config import DEFAULT_MODEL, ModelConfig
from vllm.model_executor.model_loader import (
    DUMMY_WEIGHT_BOUND,
    load_model_weights,
    resolve_model,
    resolve_quantization,
)
from vllm.model_executor.models.llama import LlamaForCausalLM


def config_only_folder(path, **overrides):
    """A model folder with config.json alone (no weights); returns its LlamaConfig."""
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    config.save_pretrained(path)
    return config


def dummy(config, path, seed=0, dtype=torch.float32):
    return load_model_weights(LlamaForCausalLM, config, str(path), "cpu", dtype, "dummy", seed)


@pytest.mark.parametrize("tied", [False, True])
def test_dummy_weights_fill_every_parameter_in_range_from_the_seed(tmp_path, tied):
    config = config_only_folder(tmp_path, tie_word_embeddings=tied)
    model = dummy(config, tmp_path, seed=3)
    for name, p in model.named_parameters():
        assert p.abs().max() <= DUMMY_WEIGHT_BOUND, name
        # Uniform over the range: no parameter left as to_empty's garbage or zeros.
        assert p.abs().max() > DUMMY_WEIGHT_BOUND / 2, name
        assert p.std() > DUMMY_WEIGHT_BOUND / 4, name
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    again, other = dummy(config, tmp_path, seed=3), dummy(config, tmp_path, seed=4)
    for (name, a), b, c in zip(
        model.named_parameters(), again.parameters(), other.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
        assert not torch.equal(a, c), name


def test_dummy_weights_compute_the_same_buffers_as_a_checkpoint_load(tmp_path):
    config = save_tiny_llama(tmp_path)  # a folder with weights: dummy ignores them
    loaded = load_model_weights(LlamaForCausalLM, config, str(tmp_path), "cpu", torch.float32)
    random = dummy(config, tmp_path)
    assert torch.equal(random.rope.cos_sin_cache, loaded.rope.cos_sin_cache)
    assert not torch.equal(random.embed_tokens.weight, loaded.embed_tokens.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dummy_weights_are_made_in_the_target_dtype(tmp_path, dtype):
    model = dummy(config_only_folder(tmp_path), tmp_path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.rope.cos_sin_cache.dtype == dtype


def test_a_folder_without_weights_names_the_dummy_format(tmp_path):
    config = config_only_folder(tmp_path)
    with pytest.raises(ValueError, match=r"no \.safetensors or pytorch_model.*load_format='dummy'"):
        load_model_weights(LlamaForCausalLM, config, str(tmp_path), "cpu", torch.float32)


def test_a_pytorch_pickle_folder_loads_as_its_safetensors_twin(tmp_path):
    """Folders with ``pytorch_model.bin`` only (EAGLE heads often ship so) load the same
    weights, read as tensors only."""
    config = save_tiny_llama(tmp_path / "st")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "st")
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "st" / "config.json", tmp_path / "bin")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    models = [
        load_model_weights(LlamaForCausalLM, config, str(tmp_path / d), "cpu", torch.float32)
        for d in ("st", "bin")
    ]
    a, b = (dict(m.named_parameters()) for m in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_load_format_is_validated():
    with pytest.raises(ValueError, match="load_format"):
        ModelConfig(load_format="pt")
    with pytest.raises(ValueError, match="quantization.*dummy"):
        ModelConfig(quantization="gguf", load_format="dummy")


def test_the_default_model_with_dummy_weights_is_not_quantized():
    # Auto picks gguf for the embedded GGUF on CPU; its blocks would overwrite the dummy
    # weights, so auto keeps them dense.
    config = ModelConfig(model=DEFAULT_MODEL, load_format="dummy")
    assert resolve_quantization(config, "cpu", torch.float32) == ("fp32", "auto: dummy weights")


def test_llm_serves_a_config_only_folder_with_dummy_weights(tmp_path):
    from vllm import LLM, SamplingParams

    config_only_folder(tmp_path, vocab_size=49152, max_position_embeddings=256)
    tokenizer_dir = resolve_model(DEFAULT_MODEL)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", tmp_path / name)
    llm = LLM(model=str(tmp_path), load_format="dummy", kv_cache_memory="16MiB")
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        out = llm.generate(["The sea is"], params)
        assert len(out[0].outputs[0].token_ids) == 5
    finally:
        llm.shutdown()
