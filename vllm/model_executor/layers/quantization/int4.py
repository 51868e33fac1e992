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

import logging

import torch
from torch import nn
from torch.utils._pytree import tree_map

from vllm.model_executor.layers import triton_w4a16
from vllm.model_executor.layers.quantization.wna16_checkpoint import QuantizedWeight

logger = logging.getLogger(__name__)

PACK = triton_w4a16.PACK
# Layers a checkpoint may quantize that stay dense here (fp8.py's KEEP_DENSE: the output
# head, which the sampler reads as a weight, and the MoE routers).
KEEP_DENSE = ("lm_head", "gate", "shared_expert_gate")


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """(K, N) 4-bit values -> (K / 8, N) int32 words, row ``8r + j`` in bits ``4j..4j+3``."""
    k, n = q.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (q.to(torch.int64).reshape(k // PACK, PACK, n) << shifts[:, None]).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def dequantize_packed(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``(out, in)`` in ``dtype`` (computed in fp32: exact) of one weight in the repacked
    layout (``qweight (in / 8, out)``, ``scales`` / ``zeros (groups, out)``), inputs in the
    packed order."""
    shifts = torch.arange(0, 32, 4, device=qweight.device)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return ((q - zeros[g].int()).float() * scales[g]).t().to(dtype)


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

    @classmethod
    def from_parts(
        cls, parts: list[QuantizedWeight], group_size: int, bias: torch.Tensor | None = None
    ) -> Int4Linear | None:
        """One layer of ``parts`` stacked along the outputs (a fused q/k/v or gate/up); None
        if a part cannot be repacked or their input orders differ."""
        layers = [cls.from_quantized(p, group_size) for p in parts]
        if any(layer is None for layer in layers):
            return None
        perms = [layer.perm for layer in layers]
        if any((p is None) != (perms[0] is None) or (p is not None and not torch.equal(p, perms[0]))
               for p in perms):  # fmt: skip
            return None
        cat = [torch.cat([getattr(layer, n) for layer in layers], 1)
               for n in ("qweight", "scales", "zeros")]  # fmt: skip
        return cls(*cat, layers[0].group_size, perms[0], bias)

    def _apply(self, fn, recurse: bool = True):
        # Module.to(dtype) casts every floating-point tensor: the fp32 scales only follow
        # device moves. A zero-size probe tells a cast from a move or to_empty.
        probe = fn(torch.empty(0, dtype=torch.float32, device=self.qweight.device))
        if probe.dtype == torch.float32:
            return super()._apply(fn, recurse)
        buffers = dict(self._buffers)
        self._buffers.clear()
        super()._apply(fn, recurse)  # the bias
        for name, buf in buffers.items():
            self._buffers[name] = None if buf is None else buf.to(probe.device)
        return self

    def to_dense(self, dtype: torch.dtype) -> nn.Linear:
        """An ``nn.Linear`` of the dequantized weight (exact: the checkpoint's values)."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = nn.Parameter(self.dequantized_weight(dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        return linear

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """(out, in) in the checkpoint's input order, computed in fp32, in ``dtype``."""
        w = dequantize_packed(self.qweight, self.scales, self.zeros, self.group_size,
                              torch.float32)  # (out, in) sorted  # fmt: skip
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


class PackedWeight(torch.Tensor):
    """A checkpoint's packed weight(s) as the dense ``(out, in)`` tensor a model's loader
    expects, without its values: a meta tensor holding the parts (``StoredWeight``s, read
    one layer at a time). The
    loader's ``torch.cat`` along rows (q/k/v, gate/up) stacks the parts; its ``copy_`` into
    a parameter records, in ``sink``, which parts reached it (the dry run of
    ``plan_int4_linears``) and writes the dequantized values (nothing into a meta tensor:
    an ``Int4Linear``'s ``weight``). Any other use (the experts' stacking) sees the
    dequantized weight in ``dtype``."""

    @staticmethod
    def __new__(cls, parts, dtype, sink):
        rows = sum(p.shape[0] for p in parts)
        data = torch.empty(rows, parts[0].shape[1], dtype=dtype, device="meta")
        t = torch.Tensor._make_subclass(cls, data)
        t.parts, t.sink = tuple(parts), sink
        return t

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.read().dequantize(self.dtype) for p in self.parts])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(func, "__name__", "") in ("__get__", "size", "dim", "numel", "__len__"):
                return func(*args, **kwargs)
            if func is torch.cat and cls._row_cat(args, kwargs):
                parts = args[0]
                return cls([q for p in parts for q in p.parts], parts[0].dtype, parts[0].sink)
            if func is torch.Tensor.copy_ and len(args) == 2 and isinstance(args[1], cls):
                dst, src = args
                src.sink[id(dst)] = (dst, src.parts)
                return dst if dst.is_meta else dst.copy_(src.dequantized())
            plain = tree_map(lambda t: t.dequantized() if isinstance(t, cls) else t, (args, kwargs))
            return func(*plain[0], **plain[1])

    @classmethod
    def _row_cat(cls, args, kwargs) -> bool:
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return dim == 0 and all(isinstance(p, cls) for p in args[0])


def plan_int4_linears(model: nn.Module, state: dict, group_size: int) -> dict[int, tuple]:
    """Before ``model`` (on the meta device) gets storage: run its ``load_weights`` on meta
    copies of ``state`` (its packed weights ``PackedWeight``s) to learn which ``nn.Linear``
    layers they fill whole, and make those ``Int4Linear``s (not ``KEEP_DENSE``; those
    whose weights repack), and each ``FusedMoE`` whose experts repack hold them packed
    (``_plan_int4_experts``), so their dense weights never exist on the device. Returns, by
    ``id`` of each such layer, its packed tensors (on the CPU) for ``fill_int4_linears``."""
    from vllm.model_executor.layers.quantization.fp8 import replace_linears

    sink: dict[int, tuple] = {}
    meta = {
        k: PackedWeight(v.parts, v.dtype, sink)
        if isinstance(v, PackedWeight)
        else torch.empty_like(v, device="meta")
        for k, v in state.items()
    }
    with torch.no_grad():
        model.load_weights(meta)
    filled: dict[int, tuple] = {}

    def make(name: str, mod: nn.Module) -> nn.Module | None:
        record = sink.get(id(getattr(mod, "weight", None)))
        if not isinstance(mod, nn.Linear) or record is None or record[0] is not mod.weight:
            return None
        if name.rpartition(".")[2] in KEEP_DENSE:
            return None
        layer = Int4Linear.from_parts([p.read() for p in record[1]], group_size)
        if layer is None or (layer.out_features, layer.in_features) != mod.weight.shape:
            return None
        tensors = {n: b for n, b in layer.named_buffers()}
        with torch.device("meta"):
            shell = Int4Linear(*(torch.empty_like(tensors[n], device="meta")
                                 for n in ("qweight", "scales", "zeros")), layer.group_size,
                               None if layer.perm is None else torch.empty_like(
                                   layer.perm, device="meta"), mod.bias)  # fmt: skip
        # What the model's loader copies the fused weight into: nothing is kept.
        shell.weight = torch.empty(mod.weight.shape, dtype=mod.weight.dtype, device="meta")
        filled[id(shell)] = tensors
        return shell

    replace_linears(model, make)
    filled.update(_plan_int4_experts(model, sink, group_size))
    return filled


def _expert_records(moe: nn.Module, sink: dict) -> dict | None:
    """``{(expert, projection): parts}`` (projection 0 gate, 1 up, 2 down) of every
    ``PackedWeight`` the dry run copied into ``moe``'s ``w13`` / ``w2`` (None: not every
    expert's three were)."""
    i, h = moe.intermediate_size, moe.hidden_size
    found = {}
    for dst, parts in sink.values():
        if dst._base is moe.w13:
            e, rest = divmod(dst.storage_offset(), 2 * i * h)
            found[(e, rest // (i * h))] = parts
        elif dst._base is moe.w2:
            found[(dst.storage_offset() // (h * i), 2)] = parts
    return found if len(found) == 3 * moe.num_experts else None


def _plan_int4_experts(model: nn.Module, sink: dict, group_size: int) -> dict[int, dict]:
    """Each ``FusedMoE`` whose every expert the dry run filled from ``PackedWeight``s, and
    whose experts all repack without a permutation of their inputs (GPTQ act-order
    experts stay dense: the grouped kernel reads each expert's inputs in one order), trades
    its dense weights for packed buffers (``use_int4_weights``). Returns, by ``id`` of each
    such layer, its stacked packed tensors (on the CPU) for ``fill_int4_linears``."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    planned: dict[int, dict] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, FusedMoE) or mod.w13 is None or mod.int4_unsupported_reason():
            continue
        records = _expert_records(mod, sink)
        if records is None:
            continue
        tensors = _repack_experts(mod, records, group_size)
        if tensors is None:
            logger.info("%s: 4-bit experts dequantized (act-order or not repackable)", name)
            continue
        mod.use_int4_weights(group_size)
        if any(tensors[n].shape != getattr(mod, n).shape for n in tensors):
            raise RuntimeError(f"{name}: repacked experts do not fit the planned buffers")
        planned[id(mod)] = tensors
    return planned


def _repack_experts(moe: nn.Module, records: dict, group_size: int) -> dict | None:
    """The experts' ``w13`` (gate and up fused) and ``w2`` repacked and stacked, by buffer
    name; None if one does not repack or needs a permutation of its inputs."""
    stacked: dict[str, list] = {}
    for e in range(moe.num_experts):
        for proj, keys in (("w13", (0, 1)), ("w2", (2,))):
            parts = [p.read() for k in keys for p in records[(e, k)]]
            layer = Int4Linear.from_parts(parts, group_size)
            if layer is None or layer.perm is not None:
                return None
            for t in ("qweight", "scales", "zeros"):
                stacked.setdefault(f"{proj}_{t}", []).append(getattr(layer, t))
    return {n: torch.stack(ts) for n, ts in stacked.items()}


def fill_int4_linears(model: nn.Module, filled: dict[int, tuple]) -> int:
    """Copy each planned ``Int4Linear``'s (and packed ``FusedMoE``'s) tensors in (after
    ``to_empty``); returns how many layers."""
    count = 0
    with torch.no_grad():
        for mod in model.modules():
            tensors = filled.get(id(mod))
            if tensors is None:
                continue
            for name, t in tensors.items():
                getattr(mod, name).copy_(t)
            count += 1
    if count != len(filled):
        raise RuntimeError(f"{len(filled)} Int4Linear layers planned, {count} found")
    return count


def dequantize_model_int4(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every ``Int4Linear`` by the ``nn.Linear`` of its dequantized weight and
    dequantize every ``FusedMoE``'s packed 4-bit experts; returns how many layers."""
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.model_executor.layers.quantization.fp8 import replace_linears

    experts = [m for m in model.modules() if isinstance(m, FusedMoE) and m.int4_group]
    for moe in experts:
        moe.dequantize_int4_weights(dtype)
    return len(experts) + replace_linears(
        model, lambda _, m: m.to_dense(dtype) if isinstance(m, Int4Linear) else None
    )
