"""FP8-KV checkpoints: their ``kv_cache_scheme`` read, their ``k_scale`` / ``v_scale``
tensors taken out of the state dict, and each layer's attention wrapped to store ``K /
k_scale`` and ``V / v_scale`` in the FP8 cache (``quantization/kv_scales.py``).

The algebra is checked on the torch backend on every batch kind, with windows, soft caps
and sinks, per tensor and per KV head: the wrapped attention over an FP8 cache equals
attention over the values an FP8 cache with those scales represents, and keys beyond
e4m3's 448 survive where a scale of 1.0 saturates them. Then the loader and the runner on a
tiny Llama checkpoint with scales."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import load_cpu_runner, runner_logits, save_tiny_llama
from tests.v1.attention.test_fp8_kv_cache import greedy_on_cuda
from tests.v1.attention.test_torch_flash import BATCHES, make_batch
from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.model_executor.layers.quantization.kv_scales import (
    KVCacheScheme,
    kv_cache_scheme_of,
    pop_kv_scales,
    resolve_cache_dtype,
    scaled_attention,
)
from vllm.v1.attention.backends import torch_sdpa
from vllm.v1.attention.kv_cache_dtype import is_fp8, to_cache

E4M3 = torch.float8_e4m3fn
FEATURES = {
    "plain": {},
    "window": {"sliding_window": 5},
    "soft_cap": {"logits_soft_cap": 3.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -2.0])},
}
SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
          "symmetric": True}  # fmt: skip


def test_scheme_is_read_and_anything_else_refused():
    assert kv_cache_scheme_of(None) is None
    assert kv_cache_scheme_of({"quant_method": "fp8"}) is None
    assert kv_cache_scheme_of({"kv_cache_scheme": SCHEME}) == KVCacheScheme("tensor")
    head = {**SCHEME, "strategy": "attn_head"}
    assert kv_cache_scheme_of({"kv_cache_scheme": head}) == KVCacheScheme("attn_head")
    for field, value in (("num_bits", 4), ("type", "int"), ("symmetric", False),
                         ("dynamic", True), ("strategy", "group")):  # fmt: skip
        bad = {"kv_cache_scheme": {**SCHEME, field: value}}
        with pytest.raises(ValueError, match=f"quantization_config.kv_cache_scheme.{field}"):
            kv_cache_scheme_of(bad)
    with pytest.raises(ValueError, match="kv_cache_scheme.colour"):
        kv_cache_scheme_of({"kv_cache_scheme": {**SCHEME, "colour": 1}})


def test_auto_becomes_fp8_for_a_checkpoint_with_a_scheme():
    class Config:
        quantization_config = {"quant_method": "compressed-tensors", "kv_cache_scheme": SCHEME}

    assert resolve_cache_dtype("auto", Config()) == "fp8"
    assert resolve_cache_dtype("fp8_e5m2", Config()) == "fp8_e5m2"
    assert resolve_cache_dtype("float32", Config()) == "float32"  # explicit wins
    assert resolve_cache_dtype("auto", object()) == "auto"


def test_scale_tensors_are_taken_out_of_the_state():
    one = torch.tensor(2.0)
    state = {
        "model.layers.0.self_attn.k_scale": one,  # llm-compressor
        "model.layers.0.self_attn.v_scale": torch.tensor([3.0]),
        "model.layers.1.self_attn.k_proj.k_scale": torch.tensor([4.0, 5.0]),  # ModelOpt
        "model.layers.1.self_attn.v_proj.v_scale": one,
        "model.layers.2.self_attn.kv_scale": torch.tensor(6.0),  # the older single scale
        "model.layers.2.self_attn.q_scale": one,  # FP8 attention's: dropped
        "model.layers.0.self_attn.k_proj.weight_scale": one,  # weights' scales stay
        "model.layers.0.self_attn.k_proj.input_scale": one,
        "model.layers.0.mlp.down_proj.weight": one,
    }
    scales = pop_kv_scales(state)
    assert set(state) == {
        "model.layers.0.self_attn.k_proj.weight_scale",
        "model.layers.0.self_attn.k_proj.input_scale",
        "model.layers.0.mlp.down_proj.weight",
    }
    got = {(layer, kv): s.tolist() for layer, d in scales.items() for kv, s in d.items()}
    assert got == {(0, "k"): [2.0], (0, "v"): [3.0], (1, "k"): [4.0, 5.0], (1, "v"): [2.0],
                   (2, "k"): [6.0], (2, "v"): [6.0]}  # fmt: skip


def _ordered(kind, block_size, heads, kv_heads, dim, seed):
    """A batch (decode rows first, as the backend takes them) with keys up to ~1,300."""
    seqs, q, k, v, cache = make_batch(kind, block_size, heads, kv_heads, dim, seed=seed)
    order = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0]))
    starts = [sum(n for _, n, _ in seqs[:i]) for i in range(len(seqs))]
    perm = torch.cat([torch.arange(starts[i], starts[i] + seqs[i][1]) for i in order])
    k, cache = k * 300, cache.clone()
    cache[0] *= 300  # the keys, beyond e4m3's 448 once in a while
    return [seqs[i] for i in order], q[perm], k[perm], v[perm] * 3, cache


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("kind", list(BATCHES))
def test_scaled_attention_reads_what_the_scaled_cache_represents(kind, features, per_head):
    heads, kv_heads, dim, block_size, scale = 6, 2, 8, 16, 0.01
    seqs, q, k, v, cache = _ordered(kind, block_size, heads, kv_heads, dim, seed=3)
    ks = torch.tensor([5.0, 4.0]) if per_head else torch.tensor([4.0, 4.0])
    vs = torch.tensor([0.05, 0.04]) if per_head else torch.tensor([0.05, 0.05])
    kf, kdiv, vdiv = FEATURES[features], ks.view(-1, 1), vs.view(-1, 1)

    def attention(q, k, v, cache):
        meta = torch_sdpa.build_metadata(seqs, block_size, "cpu")
        return torch_sdpa.paged_attention(q, k, v, cache, meta, scale, **kf)

    # What the backend stores: the values over their scales, in FP8.
    stored = cache.clone()
    stored[0], stored[1] = cache[0] / kdiv, cache[1] / vdiv
    fp8_cache = to_cache(stored, E4M3)
    wrapped = scaled_attention(
        lambda q, k, v, c, meta, s, **kw: torch_sdpa.paged_attention(q, k, v, c, meta, s, **kw),
        ks, vs, heads,
    )  # fmt: skip
    out = wrapped(q, k, v, fp8_cache, torch_sdpa.build_metadata(seqs, block_size, "cpu"), scale,
                  **kf)  # fmt: skip
    # The values that cache represents: each stored value times its scale, the step's own
    # K/V through the same rounding (written to the cache before attending).
    represented = fp8_cache.float()
    represented[0], represented[1] = represented[0] * kdiv, represented[1] * vdiv
    rk = to_cache(k / kdiv, E4M3).float() * kdiv
    rv = to_cache(v / vdiv, E4M3).float() * vdiv
    want = attention(q, rk, rv, represented)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    # Against exact attention: the scales keep the large keys that a scale of 1.0 clips.
    exact = attention(q, k, v, cache.clone())
    unscaled = attention(q, *(to_cache(t, E4M3).float() for t in (k, v)), to_cache(cache, E4M3))
    err, err_unscaled = (out - exact).abs().max(), (unscaled - exact).abs().max()
    assert err < 0.5 * err_unscaled, (err, err_unscaled)


def test_scaled_attention_needs_the_steps_kv():
    wrapped = scaled_attention(lambda *a, **k: None, torch.ones(2), torch.ones(2), 4)
    with pytest.raises(RuntimeError, match="fused cache write"):
        wrapped(torch.zeros(1, 4, 8), None, None, None, None, 1.0)


def _checkpoint_with_scales(path, config_extra: dict | None, scales: dict[str, float]):
    """A tiny Llama saved by transformers, its config given ``config_extra`` and its
    safetensors the scale tensors ``scales``."""
    save_tiny_llama(path)
    if config_extra is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config_extra)
        (path / "config.json").write_text(json.dumps(cfg))
    (file,) = path.glob("*.safetensors")
    state = load_file(file)
    state.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(state, file, metadata={"format": "pt"})


KV_ONLY = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {},
                                   "kv_cache_scheme": SCHEME}}  # fmt: skip


def _runner(path, cache_dtype="auto"):
    model = ModelConfig(model=str(path), max_model_len=128)
    cache = CacheConfig(block_size=16, cache_dtype=cache_dtype)
    return load_cpu_runner(VllmConfig(model_config=model, cache_config=cache))


def test_a_kv_scheme_checkpoint_serves_an_fp8_cache_with_its_scales(tmp_path):
    layers = 2  # the tiny Llama's
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": 0.05 * (i + 1) + (kv == "v") * 0.01
              for i in range(layers) for kv in "kv"}  # fmt: skip
    _checkpoint_with_scales(tmp_path, KV_ONLY, scales)
    runner = _runner(tmp_path)  # auto: the checkpoint's scheme makes it FP8
    assert is_fp8(runner.kv_cache_dtype) and "fp8_kv_cache" in runner.attn_backend.model_features
    heads = runner.arch.num_kv_heads
    for i, layer in enumerate(runner.model.layers):
        k, v = layer.attn_forward.kv_scales
        assert k.tolist() == pytest.approx([0.05 * (i + 1)] * heads)
        assert v.tolist() == pytest.approx([0.05 * (i + 1) + 0.01] * heads)
    exact = _runner(tmp_path, "float32")  # explicit: a cache in the model's dtype, no scales
    assert not is_fp8(exact.kv_cache_dtype)
    assert not hasattr(exact.model.layers[0].attn_forward, "kv_scales")
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))
    want, got = runner_logits(exact, ids), runner_logits(runner, ids)
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_scales_without_a_scheme_apply_to_an_explicit_fp8_cache_only(tmp_path):
    _checkpoint_with_scales(
        tmp_path,
        None,
        {
            "model.layers.1.self_attn.k_proj.k_scale": 0.5,
            "model.layers.1.self_attn.v_proj.v_scale": 0.25,
        },
    )
    auto = _runner(tmp_path)
    assert not is_fp8(auto.kv_cache_dtype)  # no scheme: auto stays the model's dtype
    assert not hasattr(auto.model.layers[1].attn_forward, "kv_scales")
    fp8 = _runner(tmp_path, "fp8")
    heads = fp8.arch.num_kv_heads
    got = [t.tolist() for t in fp8.model.layers[1].attn_forward.kv_scales]
    assert got == [[0.5] * heads, [0.25] * heads]
    # A layer the checkpoint gives no scale: 1.0, as vLLM.
    got = [t.tolist() for t in fp8.model.layers[0].attn_forward.kv_scales]
    assert got == [[1.0] * heads] * 2


def test_bad_scales_and_dtypes_are_refused(tmp_path):
    _checkpoint_with_scales(tmp_path, None, {"model.layers.0.self_attn.k_scale": -1.0})
    with pytest.raises(ValueError, match="layers.0.k_scale: KV-cache scales must be finite"):
        _runner(tmp_path, "fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16': the model runs in"):
        _runner(tmp_path, "bfloat16")  # the tiny model serves in fp32 on the CPU
    bad = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {},
                                   "kv_cache_scheme": {**SCHEME, "num_bits": 4}}}  # fmt: skip
    _checkpoint_with_scales(tmp_path, bad, {})
    with pytest.raises(ValueError, match="kv_cache_scheme.num_bits"):
        _runner(tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_on_cuda_with_checkpoint_scales_and_graphs(tmp_path):
    """The wrapped layers on the backend CUDA picks, replayed from CUDA graphs: the
    checkpoint's scales against a bf16 cache, first tokens held (a random model's near-tied
    logits may flip a later one)."""
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": 0.05 for i in range(2) for kv in "kv"}
    _checkpoint_with_scales(tmp_path, KV_ONLY, scales)
    outs = greedy_on_cuda(tmp_path, ("bfloat16", "auto"))  # auto: the scheme's FP8 cache
    assert all(len(t) == 12 for t in outs["auto"])
    firsts = sum(a[0] == b[0] for a, b in zip(outs["bfloat16"], outs["auto"], strict=True))
    assert firsts >= 3, outs
