"""Integer weight checkpoints with 16-bit activations (W4A16/W8A16): AWQ, GPTQ and
compressed-tensors ``pack-quantized``, their ``quantization_config`` read
(``WNA16CheckpointFormat.from_config``) and their packed tensors unpacked in the state dict
before the model class sees it (``prepare_wna16_state``), so the model classes load them as
dense checkpoints: each weight becomes ``(q - zero) * scale`` in the model's dtype, computed
in fp32 (exact: a small integer times an fp16 scale) and rounded once.

The conventions, as AutoAWQ, AutoGPTQ/GPTQModel, compressed-tensors and vLLM read them
(``w[o, i]`` the dense weight, ``g`` the group of input ``i``):

- ``awq`` (``version: gemm``, 4 bits): ``qweight`` int32 (in, out/8) packs 8 outputs per
  word in AWQ's interleaved order (bits ``4j..4j+3`` of word ``c`` hold output
  ``8c + AWQ_ORDER[j]``); ``qzeros`` int32 (in/g, out/8) the same way, zeros as stored;
  ``scales`` fp16 (in/g, out); ``g = i // group_size``.
- ``gptq`` (4 or 8 bits): ``qweight`` int32 (in*bits/32, out) packs consecutive inputs
  from the low bits; ``qzeros`` int32 (groups, out*bits/32) packs consecutive outputs;
  ``scales`` (groups, out); ``g_idx`` (in,) the group of each input (act-order: any
  permutation; without it ``i // group_size``; ``group_size: -1`` is one group).
  ``checkpoint_format`` ``gptq`` (AutoGPTQ's "v1", the default) stores ``zero - 1``: the
  zero is the stored value plus one, not wrapped (a stored 15 of 4 bits is 16, as AutoGPTQ
  and vLLM read it); ``gptq_v2`` (GPTQModel) stores the zero itself. Other formats
  (``marlin``, ``bitblas``...) are other layouts: refused.
- ``compressed-tensors`` ``pack-quantized``: ``weight_packed`` int32 (out, ceil(in*bits/32))
  packs consecutive inputs from the low bits, each value stored plus ``2**(bits-1)``;
  ``weight_scale`` (out, groups) (one column: per channel); ``weight_shape`` the dense
  shape; asymmetric ones a ``weight_zero_point`` (ceil(out*bits/32), groups) packed along
  outputs the same way; act-order ``group`` a ``weight_g_idx``.

Modules left unquantized (``modules_to_not_convert``, ``ignore``) are simply dense tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from vllm.model_executor.layers.quantization.checkpoint_config import (
    bad_field,
    check_keys,
    compressed_tensors_group,
)

logger = logging.getLogger(__name__)

WNA16_METHODS = ("awq", "gptq", "compressed-tensors")
# AWQ's packing order: nibble j of a word holds output 8c + AWQ_ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_FORMATS = ("gptq", "gptq_v2")

# Fields that record how a checkpoint was made or hint a runtime, not how its tensors read.
_AWQ_INERT = {"quant_method", "modules_to_not_convert", "backend", "exllama_config",
              "do_fuse", "fuse_max_seq_len", "modules_to_fuse"}  # fmt: skip
_GPTQ_INERT = {"quant_method", "damp_percent", "static_groups", "true_sequential",
               "model_name_or_path", "model_file_base_name", "meta", "dataset", "tokenizer",
               "use_exllama", "exllama_config", "max_input_length", "cache_block_outputs",
               "use_cuda_fp16", "module_name_preceding_first_block", "batch_size",
               "pad_token_id", "modules_in_block_to_quantize", "block_name_to_quantize",
               "backend", "pack_dtype", "damp_auto_increment", "mse", "lm_head",
               "modules_to_not_convert", "v2", "v2_alpha", "hyb_act", "format"}  # fmt: skip


@dataclass(frozen=True)
class WNA16CheckpointFormat:
    """How an integer-weight checkpoint's tensors are to be read. ``group_size`` -1: one
    group per output channel; ``zero_point``: asymmetric (zeros stored); ``gptq_v1``:
    GPTQ's stored zeros are one less than the zero."""

    method: str
    bits: int
    group_size: int
    zero_point: bool
    gptq_v1: bool = False

    @classmethod
    def from_config(cls, quant: Any) -> WNA16CheckpointFormat | None:
        """The format of an HF config's ``quantization_config``; None for none or another
        method (FP8 ones, compressed-tensors ``float-quantized``). ``ValueError`` naming the
        field for anything not implemented."""
        if not quant:
            return None
        if not isinstance(quant, dict):
            quant = quant.to_dict()
        method = quant.get("quant_method")
        if method == "awq":
            return _awq(quant)
        if method == "gptq":
            return _gptq(quant)
        if method == "compressed-tensors" and _is_pack_quantized(quant):
            return _compressed_tensors(quant)
        return None


def _awq(q: dict) -> WNA16CheckpointFormat:
    check_keys(q, _AWQ_INERT | {"bits", "group_size", "zero_point", "version"})
    if q.get("bits") != 4:
        raise bad_field("bits", q.get("bits"), "AWQ checkpoints of 4 bits only")
    if str(q.get("version", "gemm")).lower() != "gemm":
        raise bad_field("version", q["version"], "only 'gemm' (the others pack differently)")
    if q.get("zero_point", True) is not True:
        raise bad_field("zero_point", q["zero_point"], "AWQ GEMM checkpoints store zeros")
    if q.get("do_fuse"):
        raise bad_field("do_fuse", q["do_fuse"], "transformers' fused modules are not used here")
    return WNA16CheckpointFormat("awq", 4, _group_size(q.get("group_size"), "group_size"), True)


def _gptq(q: dict) -> WNA16CheckpointFormat:
    check_keys(q, _GPTQ_INERT | {"bits", "group_size", "sym", "desc_act", "checkpoint_format",
                                  "dynamic"})  # fmt: skip
    if q.get("bits") not in (4, 8):
        raise bad_field("bits", q.get("bits"), "GPTQ checkpoints of 4 or 8 bits only")
    fmt = q.get("checkpoint_format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise bad_field("checkpoint_format", fmt, f"only {GPTQ_FORMATS} (the others repack)")
    if q.get("format") not in (None, *GPTQ_FORMATS) or q.get("format", fmt) != fmt:
        raise bad_field("format", q["format"], f"only {fmt!r}, as checkpoint_format")
    if q.get("dynamic"):
        raise bad_field("dynamic", q["dynamic"], "per-module overrides are not implemented")
    group = _group_size(q.get("group_size"), "group_size")
    # desc_act needs no flag: g_idx (saved whenever it is set) maps every input to its group.
    return WNA16CheckpointFormat("gptq", q["bits"], group, True, gptq_v1=fmt == "gptq")


def _group_size(value: Any, field: str) -> int:
    if not isinstance(value, int) or (value <= 0 and value != -1):
        raise bad_field(field, value, "a positive integer or -1 (one group)")
    return value


def _is_pack_quantized(q: dict) -> bool:
    formats = {q.get("format")} | {g.get("format") for g in (q.get("config_groups") or {}).values()}
    return "pack-quantized" in formats


def _compressed_tensors(q: dict) -> WNA16CheckpointFormat:
    if q.get("quantization_status") not in (None, "compressed"):
        raise bad_field("quantization_status", q["quantization_status"], "only 'compressed'")
    group, where = compressed_tensors_group(q)
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise bad_field(where + key, group[key], "weight-only (W4A16/W8A16) only")
    if group.get("format", q.get("format")) != "pack-quantized":
        raise bad_field(where + "format", group.get("format"), "only 'pack-quantized'")
    w = group.get("weights") or {}
    check_keys(w, {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure",
                    "dynamic", "actorder", "observer", "observer_kwargs", "scale_dtype",
                    "zp_dtype"}, where + "weights.")  # fmt: skip
    if w.get("num_bits") not in (4, 8):
        raise bad_field(where + "weights.num_bits", w.get("num_bits"), "4 or 8")
    for key, ok in (("type", "int"), ("dynamic", False), ("block_structure", None)):
        if w.get(key, ok) != ok:
            raise bad_field(f"{where}weights.{key}", w[key], f"only {ok!r}")
    if w.get("actorder") not in (None, "group", "weight", "dynamic", "static"):
        raise bad_field(where + "weights.actorder", w["actorder"], "group, weight or none")
    strategy = w.get("strategy")
    if strategy == "group":
        size = _group_size(w.get("group_size"), where + "weights.group_size")
    elif strategy == "channel":
        size = -1
    else:
        raise bad_field(where + "weights.strategy", strategy, "group or channel")
    zero_point = not w.get("symmetric", True)
    return WNA16CheckpointFormat("compressed-tensors", w["num_bits"], size, zero_point)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned ``bits``-bit values (int32), value ``j`` of a word
    from bits ``j*bits`` up, consecutive along ``dim`` (which grows ``32 // bits`` times)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.movedim(-1, dim + 1) if dim == 0 else values
    shape = list(packed.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


def _undo_awq_order(values: torch.Tensor) -> torch.Tensor:
    """(rows, out) in AWQ's packed order -> in output order."""
    rows, cols = values.shape
    inverse = torch.tensor([AWQ_ORDER.index(k) for k in range(8)], device=values.device)
    return values.reshape(rows, cols // 8, 8)[:, :, inverse].reshape(rows, cols)


@dataclass(frozen=True)
class QuantizedWeight:
    """A dense-layout view of one packed weight: ``q`` (out, in) unsigned integers,
    ``zeros`` and ``scales`` (out, groups), ``g_idx`` (in,) the group of each input; the
    weight is ``(q - zeros[:, g_idx]) * scales[:, g_idx]``."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        z = self.zeros[:, self.g_idx].float()
        return ((self.q.float() - z) * self.scales[:, self.g_idx].float()).to(dtype)


def _groups_of(n_in: int, group_size: int, device) -> torch.Tensor:
    size = n_in if group_size == -1 else group_size
    return torch.arange(n_in, device=device) // size


def read_awq(t: dict[str, torch.Tensor], fmt: WNA16CheckpointFormat) -> QuantizedWeight:
    q = _undo_awq_order(unpack_int32(t["qweight"], 4, 1))  # (in, out)
    zeros = _undo_awq_order(unpack_int32(t["qzeros"], 4, 1))  # (groups, out)
    return QuantizedWeight(q.t(), zeros.t(), t["scales"].t(), _groups_of(q.shape[0],
                           fmt.group_size, q.device))  # fmt: skip


def read_gptq(t: dict[str, torch.Tensor], fmt: WNA16CheckpointFormat) -> QuantizedWeight:
    q = unpack_int32(t["qweight"], fmt.bits, 0)  # (in, out)
    zeros = unpack_int32(t["qzeros"], fmt.bits, 1)  # (groups, out)
    if fmt.gptq_v1:
        zeros = zeros + 1
    g_idx = t.get("g_idx")
    if g_idx is None:
        g_idx = _groups_of(q.shape[0], fmt.group_size, q.device)
    return QuantizedWeight(q.t(), zeros.t(), t["scales"].t(), g_idx.long())


def read_compressed(t: dict[str, torch.Tensor], fmt: WNA16CheckpointFormat) -> QuantizedWeight:
    out, n_in = (int(v) for v in t["weight_shape"])
    scales = t["weight_scale"]
    q = unpack_int32(t["weight_packed"], fmt.bits, 1)[:out, :n_in]
    offset = 1 << (fmt.bits - 1)
    if fmt.zero_point:
        zeros = unpack_int32(t["weight_zero_point"], fmt.bits, 0)[:out]
    else:
        zero = t.get("weight_zero_point")
        if zero is not None and bool(zero.ne(0).any()):
            raise ValueError("a symmetric checkpoint with nonzero weight_zero_point values")
        zeros = torch.full(scales.shape, offset, dtype=torch.int32)
    g_idx = t.get("weight_g_idx")
    g_idx = _groups_of(n_in, fmt.group_size, q.device) if g_idx is None else g_idx.long()
    return QuantizedWeight(q, zeros, scales, g_idx)


# Per method: the leaf that marks a packed weight, the tensors read with it (the first
# ones required), and the reader.
_LAYOUTS = {
    "awq": (("qweight", "qzeros", "scales"), (), read_awq),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",), read_gptq),
    "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape"),
                           ("weight_zero_point", "weight_g_idx"), read_compressed),
}  # fmt: skip


@dataclass(frozen=True)
class StoredWeight:
    """One packed weight's tensors as the checkpoint stores them (by leaf name), read only
    when asked (``read``: its values unpacked take 4 bytes each, 8x the packed bytes)."""

    name: str
    tensors: dict[str, torch.Tensor]
    fmt: WNA16CheckpointFormat

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's (out, in)."""
        t, bits = self.tensors, self.fmt.bits
        if self.fmt.method == "awq":
            return t["qweight"].shape[1] * 8, t["qweight"].shape[0]
        if self.fmt.method == "gptq":
            return t["qweight"].shape[1], t["qweight"].shape[0] * 32 // bits
        out, n_in = (int(v) for v in t["weight_shape"])
        return out, n_in

    def read(self) -> QuantizedWeight:
        """The values unpacked; ``ValueError`` for shapes that do not fit."""
        qw = _LAYOUTS[self.fmt.method][2](self.tensors, self.fmt)
        _check_shapes(qw, self.fmt, self.name)
        return qw


def pop_quantized_weights(
    state: dict[str, torch.Tensor], fmt: WNA16CheckpointFormat
) -> dict[str, StoredWeight]:
    """Remove each packed weight's tensors from ``state``; returns them, by the name of
    the dense weight they make (``prefix.weight``). ``ValueError`` for a missing tensor or
    one left without its weight."""
    required, optional, _ = _LAYOUTS[fmt.method]
    if fmt.zero_point and fmt.method == "compressed-tensors":
        required = (*required, "weight_zero_point")
    marker = required[0]
    found: dict[str, StoredWeight] = {}
    for name in [k for k in state if k.rpartition(".")[2] == marker]:
        prefix = name.rpartition(".")[0]
        parts = {}
        for leaf in dict.fromkeys((*required, *optional)):
            key = f"{prefix}.{leaf}"
            if key in state:
                parts[leaf] = state.pop(key)
            elif leaf in required:
                raise ValueError(f"{name} is {fmt.method}-packed but {key} is missing")
        found[f"{prefix}.weight"] = StoredWeight(name, parts, fmt)
    leaves = set(required) | set(optional)
    stray = [k for k in state if k.rpartition(".")[2] in leaves]
    if stray:
        raise ValueError(f"{stray[0]}: a {fmt.method} tensor without its {marker}")
    return found


def _check_shapes(qw: QuantizedWeight, fmt: WNA16CheckpointFormat, name: str) -> None:
    out, n_in = qw.q.shape
    groups = 1 if fmt.group_size == -1 else -(-n_in // fmt.group_size)
    if fmt.method == "gptq" and fmt.group_size != -1:
        groups = max(groups, int(qw.g_idx.max()) + 1)
    if qw.scales.shape != (out, groups) or qw.zeros.shape != (out, groups):
        raise ValueError(
            f"{name}: scales {tuple(qw.scales.shape)} / zeros {tuple(qw.zeros.shape)} "
            f"for a ({out}, {n_in}) weight in groups of {fmt.group_size}: expected "
            f"({out}, {groups}) (transposed as stored)"
        )
    if qw.g_idx.shape != (n_in,) or int(qw.g_idx.min()) < 0 or int(qw.g_idx.max()) >= groups:
        raise ValueError(f"{name}: g_idx must give each of the {n_in} inputs a group < {groups}")


def prepare_wna16_state(
    state: dict[str, torch.Tensor],
    fmt: WNA16CheckpointFormat | None,
    dtype: torch.dtype,
    keep_packed: bool = False,
) -> int:
    """Rewrite ``state`` in place for a dense model's loader: each packed weight and its
    zeros, scales and group indices become one dense ``weight`` in ``dtype`` or, with
    ``keep_packed``, a ``PackedWeight`` (``int4.py``: its values dequantized only where a
    loader uses them as dense). Returns how many (0 without a format). ``ValueError`` for
    packed tensors without a format."""
    if fmt is None:
        marks = [k for k in state if k.rpartition(".")[2] in ("qweight", "weight_packed")]
        if marks:
            raise ValueError(f"{marks[0]} is packed but the config has no quantization_config")
        return 0
    found = pop_quantized_weights(state, fmt)
    if keep_packed:
        from vllm.model_executor.layers.quantization.int4 import PackedWeight

        for name, stored in found.items():
            state[name] = PackedWeight([stored], dtype, {})
        return len(found)
    for name, stored in found.items():
        state[name] = stored.read().dequantize(dtype)
    return len(found)
