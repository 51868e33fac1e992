"""``--kv-cache-dtype fp8`` / ``fp8_e4m3`` / ``fp8_e5m2``: an FP8 KV cache.

The semantics: each K/V element is stored saturated at the FP8 type's largest finite value
and cast (scale 1.0), and attention reads exactly the stored values, the step's own K/V
too. So a backend on an FP8 cache must equal the same backend on a cache of the model's
dtype holding the same K/V rounded through FP8 (``as_stored``): checked for the torch
backend on every batch kind, with windows, soft caps and sinks, and for TORCH_FLASH_ATTN
with its kernels emulated (``varlen_attn`` on the gathered, widened K/V; the Triton
kernels' FP8 decoding is in test_triton_decode.py / test_triton_prefill.py). The runner
sizes blocks at one byte an element and passes the feature to the selector; an engine on
the tiny model serves with it.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import load_cpu_runner, runner_logits, save_tiny_llama
from tests.v1.attention.test_torch_flash import BATCHES, install, make_batch, ref_varlen_attn
from tests.v1.attention.test_triton_decode import emulated_kernel
from vllm import _custom_ops as ops
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.attention.backends import torch_sdpa, triton_decode
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend
from vllm.v1.attention.kv_cache_dtype import (
    FP8_KV_DTYPES,
    MODEL_KV_DTYPES,
    as_stored,
    is_fp8,
    kv_cache_torch_dtype,
    to_cache,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FEATURES = {
    "plain": {},
    "window": {"sliding_window": 5},
    "soft_cap": {"logits_soft_cap": 3.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -2.0])},
}


def test_names_and_saturation():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) is torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float16) is torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_inc'"):
        kv_cache_torch_dtype("fp8_inc", torch.float16)
    from typing import get_args

    from vllm.config import CacheDtype

    assert set(get_args(CacheDtype)) == {"auto", *MODEL_KV_DTYPES, *FP8_KV_DTYPES}
    assert kv_cache_torch_dtype("bfloat16", torch.bfloat16) is torch.bfloat16  # the model's
    with pytest.raises(ValueError, match="kv_cache_dtype='float16': the model runs in"):
        kv_cache_torch_dtype("float16", torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(cache_dtype="int8")
    # A plain cast to e5m2 turns out-of-range values into infinities; the cache saturates.
    x = torch.tensor([500.0, -1e4, 3.3, 1e-3, 0.0])
    assert torch.isinf((x * 1e3).to(torch.float8_e5m2).float()).any()
    assert to_cache(x * 1e3, torch.float8_e5m2).float().tolist()[:2] == [57344.0, -57344.0]
    stored = to_cache(x, torch.float8_e4m3fn).float()
    assert stored.tolist()[:2] == [448.0, -448.0] and torch.isfinite(stored).all()
    assert as_stored(x, torch.float32) is x
    assert torch.equal(as_stored(x, torch.float8_e5m2), to_cache(x, torch.float8_e5m2).float())


@pytest.mark.parametrize("kv_dtype", FP8)
def test_reshape_and_cache_writes_the_stored_bytes(kv_dtype):
    k, v = torch.randn(5, 2, 8) * 100, torch.randn(5, 2, 8)
    slots = torch.tensor([3, 17, -1, 8, 30])  # one padding token
    cache = torch.zeros(2, 4, 8, 2, 8, dtype=kv_dtype)
    ops.reshape_and_cache(k, v, cache, slots)
    flat = cache.view(2, -1, 2, 8)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(
                flat[0, slot].view(torch.uint8), to_cache(k[i], kv_dtype).view(torch.uint8)
            )
            assert torch.equal(
                flat[1, slot].view(torch.uint8), to_cache(v[i], kv_dtype).view(torch.uint8)
            )
    written = {s for s in slots.tolist() if s >= 0}
    others = [s for s in range(32) if s not in written]
    assert not flat[:, others].view(torch.uint8).any()


def _rounded(cache, k, v, kv_dtype):
    """The same batch for a cache of the model's dtype holding what an FP8 cache holds."""
    return as_stored(cache, kv_dtype), as_stored(k, kv_dtype), as_stored(v, kv_dtype)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("kind", list(BATCHES))
def test_torch_backend_reads_the_stored_values(kind, features, kv_dtype):
    heads, kv_heads, dim, block_size, scale = 6, 2, 8, 16, 0.3
    seqs, q, k, v, cache = make_batch(kind, block_size, heads, kv_heads, dim, seed=5)
    k, v, cache = k * 4, v * 4, cache * 4  # some values round, some saturate in e4m3 ... none NaN
    order = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0]))
    starts = [sum(n for _, n, _ in seqs[:i]) for i in range(len(seqs))]
    perm = torch.cat([torch.arange(starts[i], starts[i] + seqs[i][1]) for i in order])
    meta = torch_sdpa.build_metadata([seqs[i] for i in order], block_size, "cpu")
    fp8_cache = to_cache(cache, kv_dtype)
    out = torch_sdpa.paged_attention(
        q[perm], k[perm], v[perm], fp8_cache, meta, scale, **FEATURES[features]
    )
    ref_cache, rk, rv = _rounded(cache, k, v, kv_dtype)
    meta = torch_sdpa.build_metadata([seqs[i] for i in order], block_size, "cpu")
    ref = torch_sdpa.paged_attention(
        q[perm], rk[perm], rv[perm], ref_cache, meta, scale, **FEATURES[features]
    )
    # 1e-5: the model-dtype cache's decodes take the native kernel, the FP8 cache's SDPA
    # (1.5e-6 apart on an AMX Xeon); the rounding the last assertion sees is far larger.
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(fp8_cache.float(), ref_cache)  # the writes: the same values
    # And it is not the unrounded attention (the test would pass a cache it ignored).
    meta = torch_sdpa.build_metadata([seqs[i] for i in order], block_size, "cpu")
    exact = torch_sdpa.paged_attention(
        q[perm], k[perm], v[perm], cache.clone(), meta, scale, **FEATURES[features]
    )
    assert not torch.allclose(out, exact, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("mode", ["triton", "varlen"])
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_backend_reads_the_stored_values(monkeypatch, kind, mode, block_size, kv_dtype):
    varlen_calls = install(monkeypatch, ref_varlen_attn)
    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated_kernel([]))
    heads, kv_heads, dim, scale = 6, 2, 8, 0.3
    seqs, q, k, v, cache = make_batch(kind, block_size, heads, kv_heads, dim, seed=7)
    q, k, v, cache = q.bfloat16(), k.bfloat16() * 4, v.bfloat16() * 4, cache.bfloat16() * 4

    def run(cache, k, v, fp8: bool):
        backend = TorchFlashAttentionBackend(heads, kv_heads, dim, torch.bfloat16, "cpu",
                                             block_size)  # fmt: skip
        backend.decode_kernel = mode
        if fp8:
            backend.model_features = frozenset({"fp8_kv_cache"})  # as the runner sets it
        assert backend.paged == (block_size == 256 and not fp8)
        assert not backend.writes_kv_with_rotary
        return backend.forward(q, k, v, cache, backend.build_metadata(seqs), scale)

    fp8_cache = to_cache(cache, kv_dtype)
    out = run(fp8_cache, k, v, True)
    ref_cache, rk, rv = _rounded(cache, k, v, kv_dtype)
    ref = run(ref_cache, rk, rv, False)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # same values, same kernels
    assert torch.equal(fp8_cache.to(torch.bfloat16), ref_cache)
    assert all(c.get("block_table") is None for c in varlen_calls[: len(varlen_calls) // 2])


def test_backends_that_read_fp8_caches():
    fp8 = frozenset({"fp8_kv_cache"})
    assert torch_sdpa.TorchSDPABackend.unsupported_features(fp8) == []
    assert TorchFlashAttentionBackend.unsupported_features(fp8) == []
    (reason,) = FlashAttentionBackend.unsupported_features(fp8)
    assert "fp8 kv cache" in reason


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_runner_sizes_and_serves_an_fp8_cache(tmp_path, cache_dtype):
    save_tiny_llama(tmp_path)
    model = ModelConfig(model=str(tmp_path), max_model_len=128)

    def runner(dtype):
        return load_cpu_runner(VllmConfig(model_config=model, cache_config=CacheConfig(
            block_size=16, cache_dtype=dtype)))  # fmt: skip

    auto, fp8 = runner("auto"), runner(cache_dtype)
    # fp32 model: four bytes an element against one.
    assert auto.get_kv_cache_bytes_per_block() == 4 * fp8.get_kv_cache_bytes_per_block()
    assert "fp8_kv_cache" in fp8.attn_backend.model_features
    assert "fp8_kv_cache" not in auto.attn_backend.model_features
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))
    want, got = runner_logits(auto, ids), runner_logits(fp8, ids)
    assert is_fp8(fp8.kv_caches[0].dtype) and not is_fp8(auto.kv_caches[0].dtype)
    # Close to the exact cache's logits, and not equal to them (the cache rounds).
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert not torch.equal(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_engine_serves_with_an_fp8_cache(tmp_path):
    from vllm import LLM, SamplingParams

    llm = LLM(kv_cache_dtype="fp8", max_model_len=256, kv_cache_memory="16MiB")
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8,
                                                                        temperature=0))  # fmt: skip
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def greedy_on_cuda(model_dir, cache_dtypes) -> dict[str, list]:
    """Per ``--kv-cache-dtype``: the greedy tokens of four 37-token prompts (12 each) from a
    bf16 engine on CUDA with its graphs over ``model_dir``, one engine after the other."""
    from vllm import LLM, SamplingParams

    outs = {}
    for kv in cache_dtypes:
        llm = LLM(model=str(model_dir), dtype="bfloat16", kv_cache_dtype=kv, max_model_len=128,
                  skip_tokenizer_init=True, num_gpu_blocks_override=64)  # fmt: skip
        try:
            prompts = [{"prompt_token_ids": list(range(3 + i, 40 + i))} for i in range(4)]
            res = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
            outs[kv] = [r.outputs[0].token_ids for r in res]
        finally:
            llm.shutdown()
    return outs


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("mode", ["triton", "varlen"])
@pytest.mark.parametrize("kind", list(BATCHES))
def test_real_flash_backend_reads_the_stored_values(monkeypatch, kind, mode, kv_dtype):
    # On the real kernels: an FP8 cache against a bf16 cache holding the rounded values
    # (both gathered at block size 16, so the same varlen_attn calls; the Triton kernels
    # decode the bytes to the same fp32 values).
    monkeypatch.setenv("VLLM_CUDA_DECODE_ATTENTION", mode)
    heads, kv_heads, dim, scale = 32, 8, 128, 128**-0.5
    seqs, q, k, v, cache = make_batch(kind, 16, heads, kv_heads, dim, seed=7, device="cuda",
                                      dtype=torch.bfloat16)  # fmt: skip

    def run(cache, k, v, fp8: bool):
        backend = TorchFlashAttentionBackend(heads, kv_heads, dim, torch.bfloat16, "cuda", 16)
        if fp8:
            backend.model_features = frozenset({"fp8_kv_cache"})
        return backend.forward(q, k, v, cache, backend.build_metadata(seqs), scale)

    out = run(to_cache(cache, kv_dtype), k, v, True)
    ref_cache, rk, rv = _rounded(cache, k, v, kv_dtype)
    torch.testing.assert_close(out, run(ref_cache, rk, rv, False), rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_engine_on_cuda_with_an_fp8_cache_and_graphs(tmp_path, cache_dtype):
    save_tiny_llama(tmp_path)
    outs = greedy_on_cuda(tmp_path, ("auto", cache_dtype))
    # It serves (graphs captured over the FP8 cache) and starts as the bf16 cache does: a
    # random model's near-tied logits may flip a later token, so only the first are held.
    assert all(len(t) == 12 for t in outs[cache_dtype])
    firsts = sum(a[0] == b[0] for a, b in zip(outs["auto"], outs[cache_dtype], strict=True))
    assert firsts >= 3, outs
