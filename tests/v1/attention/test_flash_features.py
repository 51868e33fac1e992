"""TORCH_FLASH_ATTN with soft-capped scores (Gemma 2) and attention sinks (gpt-oss).

On CPU the three kernels are emulations that check their arguments (``ref_varlen_attn``,
with its log-sum-exp; the Triton decode and prefill kernels in float64): the backend's
output on prefill, decode, chunked and mixed batches, in either decode mode, equals the
float64 reference written out, and each row goes where it should (a soft-capped layer's
non-decode rows to the Triton prefill kernel; a layer with sinks to ``varlen_attn`` asked
for its log-sum-exp, or to the prefill kernel where this torch returns none). The same
comparisons on the real kernels are marked ``cuda``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.v1.attention.test_torch_flash import (
    BATCHES,
    check_against_float64,
    install,
    ref_varlen_attn,
)
from tests.v1.attention.test_triton_decode import emulated_kernel
from tests.v1.attention.test_triton_prefill import prefill_reference
from vllm.v1.attention.backends import torch_flash, triton_decode, triton_prefill
from vllm.v1.attention.backends.torch_flash import TorchFlashAttentionBackend, sink_scaled
from vllm.v1.attention.selector import select_attention_backend

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
FEATURES = {
    "soft_cap": dict(soft_cap=30.0),
    "sinks": dict(sinks=True),
    "sinks+window": dict(sinks=True, window=5),
    "soft_cap+window": dict(soft_cap=2.0, window=5),
    "soft_cap+sinks": dict(soft_cap=5.0, sinks=True),
}


def ref_varlen_attn_no_lse(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                           window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                           block_table=None):  # fmt: skip
    """A ``varlen_attn`` without ``return_aux`` (no log-sum-exp)."""
    return ref_varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
        window_size=window_size, enable_gqa=enable_gqa, seqused_k=seqused_k,
        block_table=block_table,
    )  # fmt: skip


def emulated_prefill(calls: list):
    """``paged_prefill_attention`` in float64, checking the arguments the real one takes."""

    def kernel(q, kv_cache, block_table, seq_lens, cu_seq_q, max_q, scale, out=None, window=0,
               soft_cap=0.0, sinks=None):  # fmt: skip
        assert block_table.dtype == seq_lens.dtype == cu_seq_q.dtype == torch.int32
        assert {t.device for t in (q, kv_cache, block_table, seq_lens, cu_seq_q)} == {q.device}
        assert isinstance(max_q, int) and max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
        calls.append(dict(rows=q.shape[0], window=window, soft_cap=soft_cap, sinks=sinks))
        ref = prefill_reference(
            q, kv_cache, block_table, seq_lens, cu_seq_q, scale, window, soft_cap, sinks
        )
        return ref.to(q.dtype)

    return kernel


@pytest.mark.parametrize("lse", [True, False])
@pytest.mark.parametrize("mode", ["triton", "varlen"])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("kind", list(BATCHES))
def test_backend_matches_float64_with_the_emulations(monkeypatch, kind, features, mode, lse):
    varlen_calls = install(monkeypatch, ref_varlen_attn if lse else ref_varlen_attn_no_lse)
    decode_calls, prefill_calls = [], []
    monkeypatch.setattr(triton_decode, "paged_decode_attention", emulated_kernel(decode_calls))
    monkeypatch.setattr(triton_prefill, "paged_prefill_attention", emulated_prefill(prefill_calls))
    real_init = TorchFlashAttentionBackend.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.decode_kernel = mode  # as on a GPU with triton, or VLLM_CUDA_DECODE_ATTENTION

    monkeypatch.setattr(TorchFlashAttentionBackend, "__init__", init)
    spec = FEATURES[features]
    check_against_float64(kind, torch.float32, 16, False, 6, 2, "cpu", spec.get("window"),
                          spec.get("soft_cap"), spec.get("sinks", False))  # fmt: skip

    seqs = BATCHES[kind]
    decodes = sum(n == 1 for _, n in seqs) if mode == "triton" else 0
    others = len(seqs) - decodes
    to_prefill = others and ("soft_cap" in spec or not lse)
    assert len(decode_calls) == (1 if decodes else 0)
    assert len(prefill_calls) == (1 if to_prefill else 0)
    assert len(varlen_calls) == (1 if others and not to_prefill else 0)
    for call in decode_calls + prefill_calls:
        assert call["window"] == spec.get("window", 0)
        assert call["soft_cap"] == spec.get("soft_cap", 0.0)
        assert (call["sinks"] is not None) == spec.get("sinks", False)
    for call in varlen_calls:  # the log-sum-exp asked exactly when sinks need it
        assert (call.get("return_aux") is not None) == spec.get("sinks", False)


def test_sink_scaling_takes_either_layout_and_refuses_others():
    gen = torch.Generator().manual_seed(0)
    out, lse = torch.randn(5, 3, 4, generator=gen), torch.randn(3, 5, generator=gen)
    sinks = torch.randn(3, generator=gen)
    expected = out * (lse.t().exp() / (lse.t().exp() + sinks.exp())).unsqueeze(-1)
    torch.testing.assert_close(sink_scaled(out, lse, sinks), expected)
    torch.testing.assert_close(sink_scaled(out, lse.t().contiguous(), sinks), expected)
    with pytest.raises(RuntimeError, match="log-sum-exp"):
        sink_scaled(out, torch.zeros(4, 5), sinks)


def test_features_need_triton(monkeypatch):
    both = frozenset({"logits_soft_cap", "sinks", "sliding_window"})
    install(monkeypatch, ref_varlen_attn)
    assert TorchFlashAttentionBackend.unsupported_features(both) == []
    monkeypatch.setattr(torch_flash, "triton_installed", lambda: False)
    (reason,) = TorchFlashAttentionBackend.unsupported_features(both)
    assert "logits soft cap and sinks" in reason and "triton" in reason


def test_selector_picks_it_for_gemma2_and_gpt_oss(monkeypatch):
    # As on a GPU (the device checks stubbed): the selector no longer passes over it for
    # soft caps and sinks, and does where triton is missing.
    install(monkeypatch, ref_varlen_attn)
    monkeypatch.setattr(TorchFlashAttentionBackend, "validate_configuration",
                        classmethod(lambda cls, *a: []))  # fmt: skip
    cuda = torch.device("cuda")
    for features in ({"logits_soft_cap", "sliding_window"}, {"sinks", "sliding_window"}):
        cls = select_attention_backend(cuda, torch.bfloat16, 16, 64, None, frozenset(features))
        assert cls is TorchFlashAttentionBackend
    monkeypatch.setattr(torch_flash, "triton_installed", lambda: False)
    cls = select_attention_backend(cuda, torch.bfloat16, 16, 64, None, frozenset({"sinks"}))
    assert cls is not TorchFlashAttentionBackend


def test_the_no_lse_emulation_has_no_return_aux():
    assert "return_aux" not in inspect.signature(ref_varlen_attn_no_lse).parameters
    assert not torch_flash.VarlenFeatures.of(ref_varlen_attn_no_lse).lse


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("mode", ["triton", "varlen"])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("kind", list(BATCHES))
@pytest.mark.parametrize(("block_size", "paged"), [(16, False), (256, True)])
def test_real_kernels_match_float64(monkeypatch, kind, features, mode, block_size, paged):
    monkeypatch.setenv("VLLM_CUDA_DECODE_ATTENTION", mode)
    spec = FEATURES[features]
    features = (spec.get("window"), spec.get("soft_cap"), spec.get("sinks", False))
    check_against_float64(kind, torch.bfloat16, block_size, paged, 32, 8, "cuda", *features)
