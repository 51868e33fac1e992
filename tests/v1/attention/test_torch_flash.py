"""The TORCH_FLASH_ATTN backend (torch's ``varlen_attn`` over the paged cache).

On CPU: ``ref_varlen_attn`` emulates the documented forward of torch's ``varlen_attn``
(packed varlen, ``block_table`` pages with ``seqused_k``, GQA, the causal mask asked for
with ``window_size=(-1, 0)`` and aligned to the bottom-right corner) and checks the
arguments the real kernel checks; installed in place of torch's, the backend's output must
equal a float64 SDPA reference and the torch backend on mixed batches. The whole forward
also runs under FakeTensorMode on fake CUDA tensors with torch's own ``varlen_attn`` (its
fake kernel): shapes, dtypes and devices are checked, and any read of a device value (a
host sync) would raise there. The same comparisons against the real kernel are marked
``cuda``.
"""

from __future__ import annotations

import inspect
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from vllm import _custom_ops as ops
from vllm.v1.attention.backends import torch_flash, torch_sdpa
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend, VarlenFeatures

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def ref_varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q,
    max_k,
    *,
    return_aux=None,
    scale=None,
    window_size=(-1, -1),
    enable_gqa=False,
    seqused_k=None,
    block_table=None,
    num_splits=None,
):
    """torch 2.13's ``varlen_attn`` forward in plain torch (float64 inside). ``window_size``
    ``(left, right)``: -1 unbounded; ``right`` 0 is causal, ``left`` >= 0 a sliding window.
    ``return_aux`` with ``lse``: also the rows' natural log-sum-exp of the scaled scores,
    (heads, tokens) float32 as FlashAttention returns it."""
    assert isinstance(window_size, tuple)  # varlen_attn compares it to the tuple (-1, 0)
    left, right = window_size
    assert right in (-1, 0) and left >= -1 and (left == -1 or right == 0)
    causal = right == 0
    assert query.dtype == key.dtype == value.dtype
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    devices = {t.device for t in (query, key, value, cu_seq_q, cu_seq_k)}
    if block_table is not None:
        assert seqused_k is not None and seqused_k.dtype == block_table.dtype == torch.int32
        assert key.dim() == 4 and key.shape[1] % 256 == 0  # mha_varlen_fwd's page rule
        assert block_table.stride(-1) == 1
        devices |= {seqused_k.device, block_table.device}
    else:
        assert key.dim() == 3 and key.shape[0] == int(cu_seq_k[-1])  # packed keys
    assert len(devices) == 1
    heads, kv_heads, head_dim = query.shape[1], key.shape[-2], query.shape[2]
    assert heads == kv_heads or (enable_gqa and heads % kv_heads == 0)
    scale = scale if scale is not None else 1 / math.sqrt(head_dim)
    out = torch.zeros_like(query)
    lse = torch.zeros(heads, query.shape[0], dtype=torch.float32, device=query.device)
    for i in range(len(cu_seq_q) - 1):
        qs, qe = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        len_k = int(seqused_k[i]) if seqused_k is not None else int(cu_seq_k[i + 1] - cu_seq_k[i])
        assert qe - qs <= max_q and len_k <= max_k
        if block_table is not None:
            pages = block_table[i, : -(-len_k // key.shape[1])].long()
            keys, values = key[pages].flatten(0, 1)[:len_k], value[pages].flatten(0, 1)[:len_k]
        else:
            ks = int(cu_seq_k[i])
            keys, values = key[ks : ks + len_k], value[ks : ks + len_k]
        group = heads // kv_heads
        keys = keys.double().repeat_interleave(group, dim=1)  # query head h: KV head h // group
        values = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[qs:qe].double(), keys) * scale
        if causal:  # bottom-right: query row j sees keys [0, len_k - len_q + j]
            rows = torch.arange(qe - qs, device=query.device)[:, None] + (len_k - (qe - qs))
            keys_at = torch.arange(len_k, device=query.device)[None, :]
            scores = scores.masked_fill(keys_at > rows, float("-inf"))
            if left >= 0:  # and not before row - left
                scores = scores.masked_fill(keys_at < rows - left, float("-inf"))
        out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(query.dtype)
        lse[:, qs:qe] = scores.logsumexp(-1).float()
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


def ref_varlen_attn_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
    """An older ``varlen_attn``: ``is_causal``, no scale=, no GQA, no pages."""
    window = (-1, 0) if is_causal else (-1, -1)
    return ref_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window)


def sdpa_reference(seqs, q, kv_cache, scale, block_size, window=None, soft_cap=None,
                   sinks=None):  # fmt: skip
    """Float64 SDPA per sequence over its context read back from ``kv_cache`` (after the
    step's writes) through its block ids, with an explicit bottom-right causal mask (and
    the last ``window`` positions only, when given); with ``soft_cap`` or ``sinks``, the
    same attention written out (scores capped, each head's sink logit in its softmax)."""
    out, start = torch.empty(q.shape, dtype=torch.float64, device=q.device), 0
    for computed, new, block_ids in seqs:
        total = computed + new
        slots = [block_ids[p // block_size] * block_size + p % block_size for p in range(total)]
        index = torch.tensor(slots, device=q.device)
        flat = kv_cache.flatten(1, 2).double()  # (2, num_blocks * block_size, kv_heads, dim)
        keys, values = flat[0][index].transpose(0, 1), flat[1][index].transpose(0, 1)
        mask = torch.ones(new, total, dtype=torch.bool, device=q.device).tril(computed)
        if window is not None:
            mask = mask.triu(computed - window + 1)
        query = q[start : start + new].double().transpose(0, 1)
        if soft_cap is None and sinks is None:
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
            )
        else:
            group = query.shape[0] // keys.shape[0]
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
            scores = query @ keys.transpose(1, 2) * scale
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            scores = scores.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                sink = sinks.double().view(-1, 1, 1).expand(*scores.shape[:2], 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
            else:
                probs = scores.softmax(-1)
            o = probs @ values
        out[start : start + new] = o.transpose(0, 1)
        start += new
    return out


# (computed, new) per kind of batch: the last context is longer than 256, so with pages of
# 256 it spans two.
BATCHES = {
    "prefill": [(0, 7), (0, 3), (0, 270)],
    "decode": [(9, 1), (3, 1), (300, 1)],
    "chunked": [(6, 5), (250, 10), (256, 4)],
    "mixed": [(9, 1), (0, 7), (3, 1), (6, 5), (250, 10)],
}


def make_batch(kind, block_size, heads, kv_heads, dim, seed, device="cpu", dtype=torch.float32):
    """Scattered block ids (non-contiguous, never the null block 0) and a cache of random
    contents everywhere (block 0 too, so a read of it shows)."""
    lens = BATCHES[kind]
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-(c + n) // block_size) for c, n in lens]
    num_blocks = sum(needs) + 3
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    it = iter(ids)
    seqs = [
        (c, n, [next(it) for _ in range(need)]) for (c, n), need in zip(lens, needs, strict=True)
    ]
    tokens = sum(n for _, n in lens)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen)
    return seqs, *(t.to(device, dtype) for t in (q, k, v, cache))


def install(monkeypatch, fn):
    """Make ``fn`` the backend's ``varlen_attn``; returns the list of its calls' kwargs."""
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return fn(*args, **kwargs)

    recording.__signature__ = inspect.signature(fn)
    monkeypatch.setattr(torch_flash, "load_varlen_attn", lambda: recording)
    return calls


def test_features_are_read_from_the_signature():
    assert VarlenFeatures.of(ref_varlen_attn) == VarlenFeatures(
        True, True, True, "window_size", lse=True
    )
    assert VarlenFeatures.of(ref_varlen_attn_old) == VarlenFeatures(
        False, False, False, "is_causal"
    )
    # This machine's torch (2.13) has the paged API; a GPU machine's 2.11 has not.
    real = torch_flash.load_varlen_attn()
    if real is not None and "block_table" in inspect.signature(real).parameters:
        assert VarlenFeatures.of(real).paged


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize(
    ("block_size", "api"), [(4, "new"), (16, "new"), (256, "new"), (16, "old")]
)
def test_backend_matches_float64_and_torch_backend(monkeypatch, kind, block_size, api):
    calls = install(monkeypatch, ref_varlen_attn if api == "new" else ref_varlen_attn_old)
    heads, kv_heads, dim, scale = 6, 2, 8, 0.3
    seqs, q, k, v, cache = make_batch(kind, block_size, heads, kv_heads, dim, seed=block_size)
    backend = TorchFlashAttentionBackend(heads, kv_heads, dim, torch.float32, "cpu", block_size)
    assert backend.paged == (api == "new" and block_size == 256)

    flash_cache = cache.clone()
    meta = backend.build_metadata(seqs)
    out = backend.forward(q, k, v, flash_cache, meta, scale)
    assert len(calls) == 1 and (calls[0].get("block_table") is not None) == backend.paged

    # The step's K/V are in the cache, and nothing else changed.
    expected_cache = cache.clone()
    ops.reshape_and_cache(k, v, expected_cache, meta.slot_mapping)
    torch.testing.assert_close(flash_cache, expected_cache, rtol=0, atol=0)
    ref = sdpa_reference(seqs, q, flash_cache, scale, block_size)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)

    # The torch backend wants decodes first: its rows are a permutation of ours.
    starts = [sum(n for _, n, _ in seqs[:i]) for i in range(len(seqs))]
    order = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0]))
    perm = torch.cat([torch.arange(starts[i], starts[i] + seqs[i][1]) for i in order])
    tmeta = torch_sdpa.build_metadata([seqs[i] for i in order], block_size, "cpu")
    torch_out = torch_sdpa.paged_attention(q[perm], k[perm], v[perm], cache.clone(), tmeta, scale)
    torch.testing.assert_close(out[perm], torch_out, rtol=1e-5, atol=1e-5)


def test_reference_detects_a_wrong_causal_alignment():
    # Guards the emulation: a top-left mask would differ for chunks over a prefix.
    seqs, q, k, v, cache = make_batch("chunked", 16, 4, 2, 8, seed=1)
    backend = TorchFlashAttentionBackend(4, 2, 8, torch.float32, "cpu", 16)
    meta = backend.build_metadata(seqs)
    flat = cache.flatten(1, 2)
    keys, values = flat[0][meta.gather_slots], flat[1][meta.gather_slots]
    args = (q, keys, values, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k)
    causal = ref_varlen_attn(*args, window_size=(-1, 0), enable_gqa=True)
    top_left = torch.zeros_like(q)
    for i, (c, n, _) in enumerate(seqs):  # query row j sees keys [0, j] only
        qs, ks = int(meta.cu_seq_q[i]), int(meta.cu_seq_k[i])
        sub = (q[qs : qs + n], keys[ks : ks + c + n], values[ks : ks + c + n])
        cu = torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, c + n], dtype=torch.int32)
        full = ref_varlen_attn(*sub, *cu, n, c + n, window_size=(-1, -1), enable_gqa=True)
        top_left[qs : qs + n] = full  # every key visible: differs from causal too
    assert not torch.allclose(causal, top_left)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_on_fake_cuda_tensors(block_size, dtype):
    # torch's own varlen_attn (fake kernel) on fake cuda:0 tensors: the metadata lands on
    # the device, the call's shapes are accepted, and no value is read back (a sync would
    # raise DataDependentOutputException under FakeTensorMode).
    heads, kv_heads, dim = 8, 2, 64
    lens = BATCHES["mixed"]
    dev = torch.device("cuda", 0)
    with FakeTensorMode():
        backend = TorchFlashAttentionBackend(heads, kv_heads, dim, dtype, dev, block_size)
        assert backend.paged == (block_size == 256)  # this machine's torch has block_table
        num_blocks = sum(-(-(c + n) // block_size) for c, n in lens) + 1
        it = iter(range(1, num_blocks))
        seqs = [(c, n, [next(it) for _ in range(-(-(c + n) // block_size))]) for c, n in lens]
        meta = backend.build_metadata(seqs)
        tensors = [meta.slot_mapping, meta.cu_seq_q, meta.cu_seq_k, meta.seqused_k]
        tensors += [meta.block_table] + ([] if meta.paged else [meta.gather_slots])
        assert {t.device for t in tensors} == {dev}
        tokens = sum(n for _, n in lens)
        q = torch.empty(tokens, heads, dim, dtype=dtype, device=dev)
        k = torch.empty(tokens, kv_heads, dim, dtype=dtype, device=dev)
        v = torch.empty(tokens, kv_heads, dim, dtype=dtype, device=dev)
        cache = torch.empty(2, num_blocks, block_size, kv_heads, dim, dtype=dtype, device=dev)
        out = backend.forward(q, k, v, cache, meta, dim**-0.5)
        assert out.shape == q.shape and out.dtype == dtype and out.device == dev
        # The mode does catch a read-back, and a CPU tensor mixed in.
        with pytest.raises(DataDependentOutputException):
            bool((meta.seqused_k > 0).all())
        with pytest.raises(Exception, match="[Dd]evice"):
            backend.forward(q, k, v, torch.empty(cache.shape, dtype=dtype), meta, 0.1)


def test_metadata_lands_on_the_backends_device():
    # Regression guard: a CPU table next to CUDA q/k/v fails in the kernel; fake CUDA here.
    with FakeTensorMode():
        dev = torch.device("cuda", 0)
        backend = TorchFlashAttentionBackend(4, 4, 64, torch.bfloat16, dev, 16)
        meta = backend.build_metadata([(3, 1, [1])])
        assert meta.block_table.device == meta.gather_slots.device == dev


def test_detail_names_the_path(monkeypatch):
    install(monkeypatch, ref_varlen_attn)
    assert "block_table" in TorchFlashAttentionBackend(4, 4, 8, torch.float16, "cpu", 512).detail
    gathered = TorchFlashAttentionBackend(4, 4, 8, torch.float16, "cpu", 16).detail
    assert "16 is not a multiple of 256" in gathered and "gathered" in gathered
    install(monkeypatch, ref_varlen_attn_old)
    old = TorchFlashAttentionBackend(4, 4, 8, torch.float16, "cpu", 256).detail
    assert "no block_table" in old


def test_unavailable_reason_on_this_build(monkeypatch):
    # A CPU-only torch has varlen_attn but no FlashAttention kernels.
    if not HAS_CUDA:
        reason = torch_flash.flash_unavailable_reason(torch.device("cuda"))
        assert reason == "this torch was built without FlashAttention"
    monkeypatch.setattr(torch_flash, "load_varlen_attn", lambda: None)
    assert "no torch.nn.attention.varlen" in torch_flash.flash_unavailable_reason(None)


# -- on a GPU ---------------------------------------------------------------------------


def check_against_float64(kind, dtype, block_size, paged, heads, kv_heads, device, window=None,
                          soft_cap=None, sinks=False):  # fmt: skip
    """The backend's output within the dtype's rounding of the float64 SDPA reference, and
    each new token's K/V at its slot bit for bit (nothing else in the cache touched); with
    ``window``, as a sliding-window layer; with ``soft_cap`` and ``sinks`` (random sink
    logits per head), as Gemma 2's and gpt-oss's layers."""
    dim, scale = 128, 128**-0.5
    seqs, q, k, v, cache = make_batch(
        kind, block_size, heads, kv_heads, dim, seed=3, device=device, dtype=dtype
    )
    if soft_cap is not None:  # scores wide enough for the cap to bend them
        q = q * 8
    gen = torch.Generator().manual_seed(4)
    sink_logits = (torch.randn(heads, generator=gen) * 3).to(device, dtype) if sinks else None
    backend = TorchFlashAttentionBackend(heads, kv_heads, dim, dtype, device, block_size)
    if paged and not backend.paged:
        pytest.skip("this torch's varlen_attn has no block_table")
    backend.paged = paged  # gathered at 256 too: both paths on the same data
    written = cache.clone()
    features = {} if window is None else {"sliding_window": window}
    if soft_cap is not None:
        features["logits_soft_cap"] = soft_cap
    if sinks:
        features["sinks"] = sink_logits
    out = backend.forward(q, k, v, written, backend.build_metadata(seqs), scale, **features)
    assert out.shape == q.shape and out.dtype == dtype and out.device == q.device
    ref = sdpa_reference(seqs, q, written, scale, block_size, window, soft_cap, sink_logits)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    expected, start = cache.clone(), 0
    for c, n, ids in seqs:
        for j in range(n):
            p = c + j
            expected[:, ids[p // block_size], p % block_size] = torch.stack(
                (k[start + j], v[start + j])
            )
        start += n
    assert torch.equal(written, expected)


@pytest.mark.parametrize("kind", ["mixed", "decode"])
@pytest.mark.parametrize(("block_size", "paged"), [(16, False), (256, True)])
def test_the_gpu_check_itself_with_the_emulation(monkeypatch, kind, block_size, paged):
    # The GPU test below, run here with the emulated kernel (so its own logic is tested).
    install(monkeypatch, ref_varlen_attn)
    check_against_float64(kind, torch.bfloat16, block_size, paged, 32, 8, "cpu")


@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize(("block_size", "paged"), [(16, False), (256, True)])
def test_sliding_window_with_the_emulation(monkeypatch, kind, block_size, paged):
    """A sliding-window layer asks varlen_attn for window_size=(w - 1, 0): the float64
    reference's window, and the torch backend's, within rounding."""
    calls = install(monkeypatch, ref_varlen_attn)
    check_against_float64(kind, torch.float32, block_size, paged, 6, 2, "cpu", window=5)
    assert {c["window_size"] for c in calls} == {(4, 0)}
    seqs, q, k, v, cache = make_batch(kind, block_size, 6, 2, 8, seed=1)
    backend = TorchFlashAttentionBackend(6, 2, 8, torch.float32, "cpu", block_size)
    out = backend.forward(q, k, v, cache.clone(), backend.build_metadata(seqs), 0.3,
                          sliding_window=5)  # fmt: skip
    starts = [sum(n for _, n, _ in seqs[:i]) for i in range(len(seqs))]
    order = sorted(range(len(seqs)), key=lambda i: not (seqs[i][1] == 1 and seqs[i][0]))
    perm = torch.cat([torch.arange(starts[i], starts[i] + seqs[i][1]) for i in order])
    tmeta = torch_sdpa.build_metadata([seqs[i] for i in order], block_size, "cpu")
    torch_out = torch_sdpa.paged_attention(
        q[perm], k[perm], v[perm], cache.clone(), tmeta, 0.3, sliding_window=5
    )
    torch.testing.assert_close(out[perm], torch_out, rtol=1e-5, atol=1e-5)


def test_sliding_window_needs_a_varlen_attn_with_window_size(monkeypatch):
    window = frozenset({"sliding_window"})
    install(monkeypatch, ref_varlen_attn)
    assert TorchFlashAttentionBackend.unsupported_features(window) == []
    assert TorchFlashAttentionBackend.unsupported_features(frozenset({"dual_chunk"}))
    install(monkeypatch, ref_varlen_attn_old)
    assert "window_size" in TorchFlashAttentionBackend.unsupported_features(window)[0]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize(("block_size", "paged"), [(16, False), (256, True)])
def test_real_kernel_sliding_window_matches_float64_sdpa(kind, block_size, paged):
    check_against_float64(kind, torch.bfloat16, block_size, paged, 32, 8, "cuda", window=40)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("block_size", "paged"), [(16, False), (256, False), (256, True)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (8, 8)])
def test_real_kernel_matches_float64_sdpa(kind, dtype, block_size, paged, heads, kv_heads):
    check_against_float64(kind, dtype, block_size, paged, heads, kv_heads, "cuda")


@pytest.mark.cuda
@needs_cuda
def test_selector_picks_it_on_a_real_gpu():
    from vllm.v1.attention.selector import select_attention_backend

    cls = select_attention_backend(torch.device("cuda"), torch.bfloat16, 16, 128)
    assert cls is TorchFlashAttentionBackend
    assert select_attention_backend(torch.device("cuda"), torch.float32, 16, 128).name == (
        "TORCH_SDPA"
    )
