"""``Int4Linear``: a linear layer whose weight stays 4-bit, multiplied by the Triton W4A16
GEMM (``layers/triton_w4a16.py``), for AWQ, GPTQ and compressed-tensors int4 checkpoints.

Every format is repacked at load into the one layout the kernel reads (``from_quantized``,
from a ``QuantizedWeight`` of ``wna16_checkpoint.py``): values packed eight a word along
the input dimension, one fp32 scale and one uint8 zero per (group, output). GPTQ's act-order
(a ``g_idx`` that is a permutation of groups) becomes a permutation of the inputs at load:
the weight's inputs are sorted by group, so each group is contiguous again, and the forward
gathers the activations' columns the same way (``x[:, perm]``, on the device; the same
products, exactly). A ``g_idx`` of any other shape, 8-bit values or an input count not a
multiple of 8 are not repacked (``from_quantized`` returns None: such a weight is served
dequantized).
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers import triton_w4a16
from vllm.model_executor.layers.quantization.wna16_checkpoint import QuantizedWeight

PACK = triton_w4a16.PACK


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """(K, N) 4-bit values -> (K / 8, N) int32 words, row ``8r + j`` in bits ``4j..4j+3``."""
    k, n = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (q.to(torch.int64).reshape(k // PACK, PACK, n) << shifts[:, None]).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def act_order_permutation(g_idx: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """The input order that makes ``g_idx``'s groups contiguous runs of ``group_size``
    (None: it already is); ``ValueError`` if no order does."""
    perm = torch.argsort(g_idx, stable=True)
    k = g_idx.numel()
    expected = torch.arange(k, device=g_idx.device) // group_size
    if not torch.equal(g_idx[perm], expected):
        raise ValueError(f"g_idx is not a permutation of groups of {group_size}")
    if torch.equal(perm, torch.arange(k, device=g_idx.device)):
        return None
    return perm


class Int4Linear(nn.Module):
    """``y = x @ W^T + bias`` with ``W (out, in)`` 4-bit: ``W[o, i] = (q - zeros) * scales`` of
    input ``i``'s group, held as ``qweight (in / 8, out)`` int32, ``scales (groups, out)``
    fp32 and ``zeros (groups, out)`` uint8 (buffers kept in their dtypes by
    ``Module.to(dtype)``), inputs in the order ``perm`` (None: as given). ``bias`` is a
    parameter in the model's dtype. ``y`` is in ``x``'s dtype."""

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        perm: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = qweight.shape[0] * PACK
        self.out_features = qweight.shape[1]
        self.group_size = group_size
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.register_buffer("zeros", zeros.to(torch.uint8).contiguous())
        self.register_buffer("perm", None if perm is None else perm.long())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        probe = torch.empty(0, self.in_features, device="meta")
        triton_w4a16.check_w4a16_args(probe, self.qweight.to("meta"), self.scales.to("meta"),
                                      self.zeros.to("meta"), group_size)  # fmt: skip

    @classmethod
    def from_quantized(
        cls, qw: QuantizedWeight, group_size: int, bias: torch.Tensor | None = None
    ) -> Int4Linear | None:
        """``qw`` repacked (group_size -1: one group); None where it cannot be (8-bit
        values or zeros, inputs not a multiple of 8, a ``g_idx`` that is not a permutation
        of whole groups)."""
        out, n_in = qw.q.shape
        if n_in % PACK or int(qw.q.max()) > 15 or int(qw.zeros.max()) > 255:
            return None
        size = n_in if group_size == -1 else group_size
        try:
            perm = act_order_permutation(qw.g_idx, size)
        except ValueError:
            return None
        q = qw.q if perm is None else qw.q[:, perm]
        return cls(pack_rows(q.t()), qw.scales.t().float(), qw.zeros.t(), size, perm, bias)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """(out, in) in the checkpoint's input order, computed in fp32, in ``dtype``."""
        shifts = torch.arange(0, 32, 4, device=self.qweight.device)
        q = ((self.qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(
            -1, self.out_features
        )
        g = torch.arange(self.in_features, device=q.device) // self.group_size
        w = ((q - self.zeros[g].int()).float() * self.scales[g]).t()  # (out, in) sorted
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        y = triton_w4a16.w4a16_linear(x2.contiguous(), self.qweight, self.scales, self.zeros,
                                      self.group_size)  # fmt: skip
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, act_order={self.perm is not None}"
        )
