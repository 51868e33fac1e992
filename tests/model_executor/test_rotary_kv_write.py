"""The model's fused K/V write: a backend that ``writes_kv_with_rotary`` gets ``k`` and
``v`` None from the Llama layer, which has written them into the cache with the rotary
embedding (``ops.rotary_embedding_and_cache``: one Triton kernel on CUDA, tested in
test_triton_ops.py; rotary then the cache write elsewhere). On the CPU both routes must
give the same caches and the same logits, bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from vllm import _custom_ops as ops
from vllm.model_executor.models.llama import LlamaArch, LlamaForCausalLM

ARCH = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            intermediate_size=96, vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
BLOCK = 4


@dataclass
class Meta:
    slot_mapping: torch.Tensor  # (T,) this step's slots
    context: list[torch.Tensor]  # per token: the slots it attends to, itself last


class CacheReadingBackend:
    """Attention that reads K/V from the paged cache only (as the CUDA backend does)."""

    def __init__(self, fused: bool) -> None:
        self.writes_kv_with_rotary = fused
        self.calls_without_kv = 0

    def forward(self, q, k, v, kv_cache, meta: Meta, scale: float):
        if k is None:
            self.calls_without_kv += 1
        else:
            ops.reshape_and_cache_torch(k, v, kv_cache, meta.slot_mapping, padded=False)
        keys, values = kv_cache.flatten(1, 2).unbind(0)  # (slots, kv_heads, head)
        out = []
        for t, slots in enumerate(meta.context):
            kt, vt = keys[slots].transpose(0, 1), values[slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(q[t][:, None], kt, vt, scale=scale,
                                               enable_gqa=True)  # fmt: skip
            out.append(o[:, 0])
        return torch.stack(out)


def run(fused: bool, steps) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaArch(**ARCH)).eval()
    backend = CacheReadingBackend(fused)
    model.set_attention_backend(backend)
    assert all(layer.rope_writes_kv == fused for layer in model.layers)
    caches = [torch.zeros(2, 8, BLOCK, 2, 16) for _ in range(ARCH["num_layers"])]
    logits = []
    table = [5, 2, 7]  # the request's blocks, out of order
    done = 0
    with torch.inference_mode():
        for ids in steps:  # one request: a prefill chunk, then decodes
            positions = torch.arange(done, done + len(ids))
            slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(done + len(ids))]
            meta = Meta(
                torch.tensor(slots[done:]),
                [torch.tensor(slots[: p + 1]) for p in positions.tolist()],
            )
            hidden = model(torch.tensor(ids), positions, meta, caches)
            logits.append(model.compute_logits(hidden[-1:]))
            done += len(ids)
    return logits, caches, backend.calls_without_kv


@pytest.mark.parametrize("steps", [[[3, 17, 99, 4, 8, 60]], [[3, 17, 99], [4], [8], [60, 1]]])
def test_the_fused_write_gives_the_same_caches_and_logits(steps):
    plain, plain_caches, plain_calls = run(False, steps)
    fused, fused_caches, fused_calls = run(True, steps)
    assert plain_calls == 0 and fused_calls == len(steps) * ARCH["num_layers"]
    for a, b in zip(plain_caches, fused_caches, strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0
    for a, b in zip(plain, fused, strict=True):
        assert torch.equal(a, b)


def test_only_the_cuda_flash_backend_with_the_fused_ops_writes_with_the_rotary(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.attention.backends.abstract import AttentionBackend
    from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend

    fused = TorchFlashAttentionBackend.writes_kv_with_rotary.fget
    none = frozenset()
    cuda, cpu = (
        SimpleNamespace(device=torch.device("cuda"), model_features=none),
        SimpleNamespace(device=torch.device("cpu"), model_features=none),
    )
    # An FP8 KV cache is written by reshape_and_cache (the fused op writes the model's dtype).
    fp8 = SimpleNamespace(device=torch.device("cuda"), model_features=frozenset({"fp8_kv_cache"}))
    monkeypatch.setattr(ops, "_fused_module", lambda: object())  # triton there, ops on
    assert fused(cuda) is True and fused(cpu) is False and fused(fp8) is False
    monkeypatch.setattr(ops, "_fused_module", lambda: None)  # VLLM_CUDA_FUSED_OPS=0, no triton
    assert fused(cuda) is False
    assert AttentionBackend.writes_kv_with_rotary.fget(cuda) is False  # the default
