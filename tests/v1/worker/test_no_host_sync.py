"""The model's forward reads nothing back to the host (no ``.item()``, ``bool(tensor)``,
``.tolist()``, data-dependent shapes): on CUDA each such read stalls the CPU until the GPU
drains, and it breaks CUDA graph capture.

``HostSyncGuard`` fails on any of them: a TorchFunctionMode for the Python-level reads
(``Tensor.item``, ``.tolist``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``,
``.cpu()``, ``.numpy()``, ``.to("cpu")``) and a TorchDispatchMode for the aten ops that
need the host (``_local_scalar_dense``, ``nonzero``, ``masked_select``, ``unique``,
``repeat_interleave`` without ``output_size``, indexing with a bool mask).

The forward runs on the CPU but takes the code path a CUDA device takes: ``_custom_ops``
chooses its native kernels only for CPU tensors (``_op(name) if device.type == "cpu"``),
so ``_op`` is made to find none and every op runs its pure-torch version, the one CUDA
runs. Inputs and attention metadata are prepared before the guard, as the runner does
before the forward.

Attention: with a pure-torch reference backend (sync-free by construction) the whole
model — embeddings, norms, rotary, MLP, logits — is checked. The real torch backend is
checked too and is expected to fail today, inside files this test does not own:
``vllm/_custom_ops.py`` (``reshape_and_cache_torch``: ``bool(keep.all())``) and
``vllm/v1/attention/backends/torch_sdpa.py`` (``int(decode_seq_lens.max())``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from vllm import _custom_ops as ops
from vllm.model_executor.models.llama import LlamaArch, LlamaForCausalLM
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

aten = torch.ops.aten


class HostSync(AssertionError):
    pass


_HOST_READS = {
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "tensor as an index",
    torch.Tensor.cpu: "Tensor.cpu",
    torch.Tensor.numpy: "Tensor.numpy",
}
_SYNC_OPS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_consecutive,
    aten.unique_dim,
}


# Their output's length is the sum of a tensor unless output_size says it.
_SIZED_BY_DATA = (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _is_cpu(device) -> bool:
    return isinstance(device, str | torch.device) and torch.device(device).type == "cpu"


class _FunctionGuard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise HostSync(f"host read in the forward: {_HOST_READS[func]}")
        if func is torch.Tensor.to:
            target = [a for a in (*args[1:], kwargs.get("device")) if a is not None]
            if any(_is_cpu(a) for a in target):
                raise HostSync("host read in the forward: Tensor.to('cpu')")
        return func(*args, **kwargs)


class _DispatchGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _SYNC_OPS:
            raise HostSync(f"host sync in the forward: aten.{packet.__name__}")
        if func in _SIZED_BY_DATA and kwargs.get("output_size") is None:
            raise HostSync("host sync: repeat_interleave by a tensor without output_size")
        if packet in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
            if any(_is_mask(t) for t in args[1] if t is not None):
                raise HostSync(f"host sync: aten.{packet.__name__} with a bool mask")
        return func(*args, **kwargs)


class HostSyncGuard:
    """Context manager: any host read or host-syncing op inside raises ``HostSync``."""

    def __enter__(self) -> HostSyncGuard:
        self._modes = (_FunctionGuard(), _DispatchGuard())
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


# -- the guard itself catches what it claims -----------------------------------------------
@pytest.mark.parametrize(
    "read",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: bool(x.sum() > 0),
        lambda x: int(x.sum()),
        lambda x: float(x.sum()),
        lambda x: range(x.shape[0])[x.argmax()],
        lambda x: x.cpu(),
        lambda x: x.numpy(),
        lambda x: x.to("cpu"),
        lambda x: x.repeat_interleave(torch.tensor([1, 2, 1, 0])),
        lambda x: x.nonzero(),
        lambda x: x[x > 0],
        lambda x: x.masked_select(x > 0),
        lambda x: x.unique(),
        lambda x: torch.repeat_interleave(torch.tensor([1, 2])),
        lambda x: x.new_zeros(4).index_put_((x > 0,), torch.tensor(1.0)),
        lambda x: torch.arange(int(x.shape[0] * x.max())),
    ],
)
def test_the_guard_catches_every_kind_of_host_read(read):
    x = torch.randn(4)
    with pytest.raises(HostSync), HostSyncGuard():
        read(x)


def test_the_guard_lets_device_side_work_through():
    x = torch.randn(4, 8)
    idx = torch.tensor([0, 2])
    with HostSyncGuard():
        y = F.silu(x[idx]) @ x.T
        y = torch.where(y > 0, y, 0.0).softmax(-1)
        z = torch.repeat_interleave(idx, torch.tensor([1, 1]), output_size=2)
        x.index_copy_(0, idx, x[idx] * 2)
        assert y.shape == (2, 4) and x.shape[0] == 4  # shapes are host metadata
    assert z.tolist() == [0, 2]


# -- the model's forward ----------------------------------------------------------------------
@dataclass
class ReferenceMetadata:
    mask: torch.Tensor  # (num_tokens, num_tokens) bool: same request and causal


class ReferenceBackend:
    """Pure-torch attention over the step's own tokens (no prefix, no cache writes): a
    stand-in with no host reads, so the test sees the model's own."""

    @staticmethod
    def build_metadata(lengths: list[int]) -> ReferenceMetadata:
        req = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        pos = torch.arange(len(req))
        mask = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None])
        return ReferenceMetadata(mask)

    def forward(self, q, k, v, kv_cache, meta: ReferenceMetadata, scale: float):
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # (heads, T, dim)
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=meta.mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1)


ARCH = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


@pytest.fixture
def cuda_code_path(monkeypatch):
    """``_custom_ops`` finds no native kernel: every op runs the version CUDA runs."""
    monkeypatch.setattr(ops, "_op", lambda name: None)


def _model(dtype: torch.dtype, **flags) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaArch(**ARCH, **flags)).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "flags", [{}, {"attention_bias": True}, {"qk_norm": True}], ids=["llama", "qwen2", "qwen3"]
)
def test_model_forward_has_no_host_sync(cuda_code_path, dtype, flags):
    check_forward_has_no_host_sync(_model(dtype, **flags))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_forward_has_no_host_sync(cuda_code_path, dtype):
    """A mixture of experts (models/moe.py) on the grouped-GEMM path: routing, the group
    offsets and the weighted sum stay on the device."""
    from vllm.model_executor.layers import fused_moe
    from vllm.model_executor.models.moe import MoeArch, MoeForCausalLM

    arch = MoeArch(**ARCH, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=48, sparse_layers=(1,))  # fmt: skip
    torch.manual_seed(0)
    model = MoeForCausalLM(arch)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, fused_moe.FusedMoE):
                layer.w13.normal_(0, 0.05)
                layer.w2.normal_(0, 0.05)
    model = model.to(dtype).eval()
    assert fused_moe.grouped_mm_supported(
        torch.zeros(1, 64, dtype=dtype), model.layers[1].mlp.experts.w13
    )
    check_forward_has_no_host_sync(model)


@pytest.mark.parametrize("slots", [[1] * 13, [1, 0, 2] * 4 + [0]], ids=["one", "mixed"])
def test_lora_forward_has_no_host_sync(cuda_code_path, slots):
    """LoRA layers (vllm/lora): the step's slots are uploaded before the forward, as the
    runner does; the updates read nothing back."""
    from vllm.config import LoRAConfig
    from vllm.lora.manager import LoRAManager

    model = _model(torch.float32)
    config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=4)
    lora = LoRAManager(model, config, "cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    for layer in lora.layers.values():
        for slot in (1, 2):
            in_features = layer.lora_a.shape[1]
            layer.set_slot(slot, [(torch.randn(4, in_features, generator=g) * 0.1,
                                   torch.randn(width, 4, generator=g) * 0.1)
                                  for width in layer.slices])  # fmt: skip
    lora.set_token_slots(slots, "cpu")  # 13 rows: check_forward's batch
    check_forward_has_no_host_sync(model)


def check_forward_has_no_host_sync(model) -> None:
    backend = ReferenceBackend()
    model.set_attention_backend(backend)
    lengths = [5, 1, 7]  # a mixed batch: prefills and a one-token step
    ids = torch.randint(0, ARCH["vocab_size"], (sum(lengths),))
    positions = torch.cat([torch.arange(n) + 3 for n in lengths])
    meta = backend.build_metadata(lengths)
    caches = [torch.zeros(1)] * ARCH["num_layers"]  # unused by the reference
    rows = torch.tensor([4, 5, 12])  # each request's last row
    with torch.inference_mode(), HostSyncGuard():
        hidden = model(ids, positions, meta, caches)
        logits = model.compute_logits(hidden[rows])
    assert logits.shape == (3, ARCH["vocab_size"]) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_model_forward_with_the_torch_backend_has_no_host_sync(cuda_code_path):
    """A decode step and a prefill chunk over a cached prefix through the real backend."""
    model = _model(torch.float32)
    block = 4
    a = model.arch
    backend = TorchSDPABackend(a.num_heads, a.num_kv_heads, a.head_dim, torch.float32, "cpu", block)
    model.set_attention_backend(backend)
    caches = [torch.zeros(2, 8, block, a.num_kv_heads, a.head_dim) for _ in range(a.num_layers)]
    # Decode at position 5 (blocks 1, 2), then a 3-token chunk at 4..6 (blocks 3, 4).
    meta = backend.build_metadata([(5, 1, [1, 2]), (4, 3, [3, 4])])
    ids = torch.tensor([7, 8, 9, 10])
    positions = torch.tensor([5, 4, 5, 6])
    with torch.inference_mode(), HostSyncGuard():
        hidden = model(ids, positions, meta, caches)
    assert hidden.shape == (4, a.hidden_size)
    assert math.isfinite(hidden.sum())


@pytest.mark.parametrize("qtype", [ops.GGML_Q4_1, ops.GGML_Q8_0])
@pytest.mark.parametrize("rows", [1, 64], ids=["block-kernel rows", "dense rows"])
def test_gguf_linear_has_no_host_sync(cuda_code_path, qtype, rows):
    """``--quantization gguf``'s layer (layers/quantization/gguf.py) on the pure-torch path."""
    from vllm.model_executor.layers.quantization.gguf import GGUFLinear

    blocks = torch.randint(0, 256, (8, 2 * ops.GGML_BLOCK_BYTES[qtype]), dtype=torch.uint8)
    layer = GGUFLinear(blocks, qtype, torch.zeros(8), dense_min_tokens=32)
    x = torch.randn(rows, 64)
    with torch.inference_mode(), HostSyncGuard():
        y = layer(x)
    assert y.shape == (rows, 8)
