"""Gemma 4's KV cache of its layers' own shapes (``Gemma4Arch.layer_kv_shapes``,
model_runner.py's ``plan_kv_tensors``): every cache tensor has its layers' ``(num_kv_heads,
head_dim)``, no padding, where no tensor is shared between shapes (one a layer) or where
one tensor per shape costs fewer bytes than a padded one (the hybrid KV cache); the bytes
of a block are the sum of the real shapes; logits equal transformers' (also through
TORCH_FLASH_ATTN sized per shape); an engine whose blocks go to the CPU KV tier and come
back gives transformers' greedy tokens."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from tests.model_executor.test_gemma4 import gemma4_config, randomized
from tests.tiny_models import hf_greedy, load_cpu_runner, runner_logits
from tests.v1.attention.test_torch_flash import install, ref_varlen_attn
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend
from vllm.v1.worker.model_runner import plan_kv_tensors

BLOCK = 16
# (sliding, global) cache shapes (num_kv_heads, head_dim) of the tiny checkpoints.
KINDS = {
    # gemma-4-E2B's kind: the global layers' heads twice as wide, as many KV heads.
    "e2b": ({}, (2, 16), (2, 32)),
    # gemma-4-31B's kind: the sliding layers have more KV heads, the global layers wider
    # heads (and values from the keys' projection).
    "31b": (dict(num_key_value_heads=4, attention_k_eq_v=True, num_global_key_value_heads=1),
            (4, 16), (1, 32)),
}  # fmt: skip


def save(path, kind: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(gemma4_config(**{**KINDS[kind][0], **overrides}))
    randomized(hf).save_pretrained(path)
    return hf


def cpu_runner(path, hybrid: bool):
    config = VllmConfig(
        model_config=ModelConfig(model=str(path), max_model_len=128),
        cache_config=CacheConfig(block_size=BLOCK),
        scheduler_config=SchedulerConfig(
            max_model_len=128, max_num_batched_tokens=128,
            disable_hybrid_kv_cache_manager=not hybrid,
        ),
    )  # fmt: skip
    return load_cpu_runner(config)


def block_bytes(shapes) -> int:
    """fp32 bytes of one block over tensors of ``shapes`` (K and V halves)."""
    return sum(2 * BLOCK * h * d * 4 for h, d in shapes)


def test_plan_kv_tensors():
    same = ((2, 16),) * 3
    assert plan_kv_tensors((0, 1, 2), same).shapes == same
    # A tensor a layer: each its own shape.
    mixed = ((2, 16), (2, 32), (4, 16))
    plan = plan_kv_tensors((0, 1, 2), mixed)
    assert plan.shapes == mixed and plan.layer_tensor == (0, 1, 2)
    # Shared tensors (the hybrid KV cache: layers 0, 2 on tensor 0; 1, 3 on tensor 1):
    # padded into (2, 32) (64 a token) rather than 16 + 64 wide ...
    plan = plan_kv_tensors((0, 1, 0, 1), ((2, 16), (2, 16), (2, 32), (2, 32)))
    assert plan.shapes == ((2, 32), (2, 32)) and plan.layer_tensor == (0, 1, 0, 1)
    # ... split where one of each shape is smaller: (4, 16) + (1, 32) = 96 < (4, 32) = 128.
    plan = plan_kv_tensors((0, 1, 0, 1), ((4, 16), (4, 16), (1, 32), (1, 32)))
    assert plan.shapes == ((4, 16), (4, 16), (1, 32), (1, 32))
    assert plan.layer_tensor == (0, 1, 2, 3)
    # KV head counts that do not divide each other never share a padded tensor.
    plan = plan_kv_tensors((0, 0), ((3, 8), (2, 64)))
    assert plan.shapes == ((3, 8), (2, 64)) and plan.layer_tensor == (0, 1)


@pytest.mark.parametrize("hybrid", [False, True], ids=["one_tensor_a_layer", "hybrid"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_cache_tensors_have_the_layers_shapes(kind, hybrid, tmp_path):
    hf = save(tmp_path, kind)
    runner = cpu_runner(tmp_path, hybrid)
    a = runner.arch
    _, sliding, full = KINDS[kind]
    real = (sliding, full) * 3  # the layers alternate, sliding first
    assert a.layer_kv_shapes == real
    ids = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(1))
    ours = runner_logits(runner, ids)  # makes the cache
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    # Before: every tensor of the largest heads and head size.
    padded = (max(h for h, _ in real), max(d for _, d in real))
    before = block_bytes([padded] * runner.kv_groups.num_tensors)
    per_block = runner.get_kv_cache_bytes_per_block()
    num_blocks = runner.kv_caches[0].shape[1]
    tensors = list({id(t): t for t in runner.kv_caches}.values())
    assert all(t.shape[1] == num_blocks for t in tensors)  # a block id indexes each one
    assert per_block == sum(t[:, 0].numel() * 4 for t in tensors)
    shapes = [tuple(t.shape[-2:]) for t in runner.kv_caches]
    if not hybrid:  # a tensor a layer, each its own shape
        assert shapes == list(real) and len(tensors) == 6
        assert per_block == block_bytes(real)
        ratio = sum(h * d for h, d in real) / (6 * math.prod(padded))
        assert per_block == before * ratio and ratio == {"e2b": 0.75, "31b": 0.375}[kind]
    elif kind == "31b":  # 3 groups' tensors: split by shape, (4, 16) + (1, 32) < (4, 32)
        assert shapes == list(real) and len(tensors) == 6
        assert per_block == block_bytes(real) == before * 3 // 4
    else:  # (2, 16) + (2, 32) > (2, 32): the sliding layers pad into the global ones' tensors
        assert shapes == [full] * 6 and len(tensors) == 3 and per_block == before


def test_torch_flash_attends_with_each_shape(tmp_path, monkeypatch):
    """TORCH_FLASH_ATTN over a varlen kernel without ``scale=`` and ``enable_gqa=`` (it
    scales and repeats K/V heads by its instance's sizes): built for the largest shape,
    each layer attends with an instance of its own (``ShapedAttention``)."""

    def varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):
        return ref_varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size
        )

    calls = install(monkeypatch, varlen)
    hf = save(tmp_path, "31b")
    runner = cpu_runner(tmp_path, hybrid=False)
    a = runner.arch
    backend = TorchFlashAttentionBackend(
        a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, "cpu", BLOCK
    )
    assert not backend.features.scale and not backend.features.gqa
    runner.attn_backend = backend
    runner.install_attention_backend()
    ids = torch.randint(0, 96, (60,), generator=torch.Generator().manual_seed(2))
    ours = runner_logits(runner, ids)
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    assert len(calls) == 6
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    instances = runner.model.layers[0].attn_forward.instances.values()
    sizes = {(b.num_kv_heads, b.head_size) for b in instances}
    assert sizes == {(4, 32), (4, 16), (1, 32)}  # the runner's, and one a layer shape


@pytest.mark.parametrize("hybrid", [False, True], ids=["one_tensor_a_layer", "hybrid"])
def test_engine_with_the_cpu_tier_gives_transformers_tokens(hybrid, tmp_path):
    """A pool of 7 usable blocks (9 with the sliding group's) and a CPU tier, 16-token
    chunks: each prompt again after the others evicted it comes back from the tier
    (loads into tensors of each layer's shape) and every greedy output equals
    transformers'."""
    from tests.utils import copy_benchmark_tokenizer
    from vllm import LLM, SamplingParams

    hf = save(tmp_path, "31b", vocab_size=49152)
    copy_benchmark_tokenizer(tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (50, 47, 52)]
    order = [0, 1, 2, 0, 1, 2]
    expected = hf_greedy(hf, prompts, 8)
    llm = LLM(
        model=str(tmp_path), max_model_len=128, num_gpu_blocks_override=10 if hybrid else 8,
        max_num_batched_tokens=16, kv_offloading_size=0.01, enable_prefix_caching=True,
        disable_hybrid_kv_cache_manager=not hybrid,
    )  # fmt: skip
    try:
        runner = llm.engine_core.model_runner
        assert {tuple(t.shape[-2:]) for t in runner.kv_caches} == {(4, 16), (1, 32)}
        loads = []
        transfer = runner.transfer_kv

        def counting_transfer(plan):
            transfer(plan)
            loads.extend(plan.loads)
            for cpu, gpu in plan.loads:
                for tier, cache in zip(
                    runner.kv_offload.cpu_caches, runner.kv_offload.gpu_caches, strict=True
                ):
                    assert torch.equal(tier[:, cpu], cache[:, gpu])

        runner.transfer_kv = counting_transfer
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = [llm.generate({"prompt_token_ids": prompts[i]}, params)[0] for i in order]
        tier_shapes = {tuple(t.shape[-2:]) for t in runner.kv_offload.cpu_caches}
    finally:
        llm.shutdown()
    assert tier_shapes == {(4, 16), (1, 32)}
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected[i] for i in order]
    assert loads and any(o.num_cached_tokens >= BLOCK for o in outs[3:])
