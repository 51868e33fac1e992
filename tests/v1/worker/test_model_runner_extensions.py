"""The two seams of the model runner, tried from a test: a second model family and a
second attention backend, each defined and registered here, reach the runner through the
registries alone (no runner, loader or selector code names them).

The toy family: embeddings, then per layer ``x + attention(Wx, Wx, Wx)``, logits against
the embedding table. The toy backend attends nothing (returns v) but records each step's
metadata and every forward call, which shows the runner builds the metadata once per
step and hands that step's object to every layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tests.v1.worker.test_model_runner_inputs import new_req, sched_out
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.model_executor.models.registry import ModelRegistry
from vllm.v1.attention.backends import registry as backend_registry
from vllm.v1.attention.backends.abstract import AttentionBackend
from vllm.v1.worker.model_runner import ModelRunner

VOCAB, HIDDEN, HEADS, LAYERS, BLOCK = 32, 8, 2, 3, 4


@dataclass(frozen=True)
class ToyArch:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class ToyForCausalLM(nn.Module):
    @staticmethod
    def arch_from_hf(hf_config) -> ToyArch:
        heads = hf_config.num_attention_heads
        return ToyArch(
            hf_config.vocab_size,
            hf_config.hidden_size,
            hf_config.num_hidden_layers,
            heads,
            heads,
            hf_config.hidden_size // heads,
        )

    def __init__(self, arch: ToyArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            nn.Linear(arch.hidden_size, arch.hidden_size, bias=False)
            for _ in range(arch.num_layers)
        )
        self.attn = None

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
            for i, layer in enumerate(self.layers):
                layer.weight.copy_(sd[f"layers.{i}.weight"])

    def set_attention_backend(self, backend) -> None:
        self.attn = backend

    def forward(self, input_ids, positions, meta, kv_caches) -> torch.Tensor:
        a = self.arch
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(x).view(-1, a.num_heads, a.head_dim)
            x = x + self.attn.forward(h, h, h, kv_cache, meta, 1.0).reshape(x.shape)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.embed_tokens.weight.T).float()


@dataclass
class ToyStep:
    """The toy backend's per-step state: the layout it was built from, and its layers."""

    seqs: list
    forwards: int = 0


class ToyBackend(AttentionBackend):
    name = "TOY"
    priority = 100  # ahead of the built-in ones wherever it can run
    device_types = ("cpu",)
    instances: list[ToyBackend] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[ToyStep] = []
        ToyBackend.instances.append(self)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size == HIDDEN // HEADS

    def build_metadata(self, seqs) -> ToyStep:
        self.steps.append(ToyStep([(c, n, list(b)) for c, n, b in seqs]))
        return self.steps[-1]

    def forward(self, q, k, v, kv_cache, meta: ToyStep, scale):
        assert meta is self.steps[-1], "a layer got another step's metadata"
        assert kv_cache.shape == (2, kv_cache.shape[1], self.block_size, HEADS, HIDDEN // HEADS)
        meta.forwards += 1
        return v


@pytest.fixture
def toy_checkpoint(tmp_path):
    """An HF-style folder of the toy architecture (model_type llama so that transformers'
    AutoConfig reads it; the architecture decides the class)."""
    config = {
        "architectures": ["ToyForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    weights = {"embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    for i in range(LAYERS):
        weights[f"layers.{i}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.1
    save_file(weights, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(ModelRegistry, "models", dict(ModelRegistry.models))
    ModelRegistry.register_model("ToyForCausalLM", f"{__name__}:ToyForCausalLM")
    monkeypatch.setattr(backend_registry, "_REGISTRY", dict(backend_registry._REGISTRY))
    backend_registry.register_backend("TOY", f"{__name__}:ToyBackend")
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    ToyBackend.instances.clear()


@pytest.fixture
def runner(toy_checkpoint, registered):
    threads = torch.get_num_threads()
    config = VllmConfig(
        model_config=ModelConfig(model=str(toy_checkpoint)),
        cache_config=CacheConfig(block_size=BLOCK),
    )
    r = ModelRunner(config, device="cpu")
    r.load_model()
    r.initialize_kv_cache(8)
    yield r
    torch.set_num_threads(threads)


def test_toy_family_and_backend_reach_the_runner(runner):
    assert type(runner.model).__name__ == "ToyForCausalLM" and runner.arch.num_layers == LAYERS
    # The runner holds one backend instance, built with the model's shapes.
    (backend,) = ToyBackend.instances
    assert runner.attn_backend is backend and runner.model.attn is backend
    assert (backend.num_heads, backend.num_kv_heads, backend.head_size) == (HEADS, HEADS, 4)
    assert (backend.dtype, backend.device.type, backend.block_size) == (torch.float32, "cpu", 4)
    assert len(runner.kv_caches) == LAYERS

    # Step 1: two prompts. Step 2: one decode each.
    first = runner.execute_model(
        sched_out(
            new=[new_req("a", [1, 2, 3, 4, 5], [1, 2], 0), new_req("b", [6, 7], [3], 0)],
            num_scheduled={"a": 5, "b": 2},
        )
    )
    second = runner.execute_model(
        sched_out(cached=[("a", [], 5), ("b", [], 2)], num_scheduled={"a": 1, "b": 1})
    )
    assert [s.seqs for s in backend.steps] == [
        [(0, 5, [1, 2]), (0, 2, [3])],
        [(5, 1, [1, 2]), (2, 1, [3])],
    ]
    assert [s.forwards for s in backend.steps] == [LAYERS, LAYERS]  # one step object, all layers
    # The toy's greedy tokens, recomputed without the runner: x_L = x_{L-1} + W_L x_{L-1}.
    model = runner.model
    for req, out in (("a", first), ("b", first)):
        ids = torch.tensor(runner.requests[req].token_ids[:-2])
        x = model.embed_tokens(ids)
        for layer in model.layers:
            x = x + layer(x)
        assert out.sampled_token_ids[req] == [int(model.compute_logits(x[-1:]).argmax())]
    assert set(second.sampled_token_ids) == {"a", "b"}


def test_unknown_architecture_fails_the_load_by_name(toy_checkpoint, registered, monkeypatch):
    monkeypatch.setattr(ModelRegistry, "models", {})
    threads = torch.get_num_threads()
    runner = ModelRunner(VllmConfig(model_config=ModelConfig(model=str(toy_checkpoint))), "cpu")
    torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="ToyForCausalLM is not supported"):
        runner.load_model()
