"""FP8 checkpoints: their ``quantization_config`` read (``Fp8CheckpointFormat.from_config``)
and their tensors recognised in the state dict before the model class sees it
(``prepare_fp8_state``), so the model classes load them as dense checkpoints.

Three formats, their conventions as transformers and vLLM read them:

- ``quant_method: "fp8"`` (transformers' fine-grained FP8, DeepSeek-V3, Qwen3 FP8): ``weight``
  float8_e4m3fn (out, in) and ``weight_scale_inv`` fp32, one per ``weight_block_size``
  block (ceil(out / b0), ceil(in / b1)); the name notwithstanding, it multiplies. Without
  a block size the scale is one per tensor (``weight_scale_inv``, or vLLM's
  ``weight_scale``), with a static ``activation_scale`` / ``input_scale``.
- ``compressed-tensors`` (``float-quantized``, llm-compressor's FP8 and FP8_DYNAMIC):
  ``weight_scale`` per tensor (1,), per channel (out, 1) or per block, multiplying; an
  ``input_scale`` per tensor for static activations, none for dynamic ones (per token or
  per tensor). No ``input_activations``: weight-only FP8, served dequantized.
- ``fbgemm_fp8``: ``weight_scale`` (out, 1), multiplying; activations per row, their
  absmax capped at ``activation_scale_ub``.

Modules left unquantized (``modules_to_not_convert``, ``ignore``) are simply tensors in
another dtype: the dtype of each weight decides. Block-scaled weights are dequantized to
the model's dtype as they are copied in, except on CUDA with triton, where they become
``Fp8BlockLinear`` layers (weight-only: the Triton GEMM of ``triton_fp8_gemm.py``); they
and the per-tensor/channel/row ones are ``_Fp8Weight`` tensors that keep their FP8 values
and scales through the model's own ``torch.cat`` and ``copy_`` calls. The model's loader
runs once on the meta device first (``plan_fp8_linears``): each linear layer an
``_Fp8Weight`` fills whole becomes an ``Fp8Linear`` before any storage exists, so the
device never holds its dense weight; the real load copies the FP8 bytes in and
``fill_fp8_linears`` adds the scales (any other use of an ``_Fp8Weight`` sees dequantized
values).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from vllm.model_executor.layers import triton_fp8_gemm
from vllm.model_executor.layers.quantization.checkpoint_config import (
    CT_FIELDS,
    bad_field,
    check_keys,
    compressed_tensors_group,
)
from vllm.model_executor.layers.quantization.fp8 import (
    FP8_DTYPE,
    KEEP_DENSE,
    Fp8BlockLinear,
    Fp8Linear,
    block_fp8_supported,
    dequantize_fp8_blocks,
    fp8_shape_ok,
    replace_linears,
)

logger = logging.getLogger(__name__)

FP8_METHODS = ("fp8", "compressed-tensors", "fbgemm_fp8")
# Methods a model class reads itself (gpt-oss expands its MXFP4 experts at load).
MODEL_METHODS = ("mxfp4",)


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    """How an FP8 checkpoint's tensors are to be read. ``activation``: "token", "tensor" or
    "static" (``Fp8Linear``'s schemes), None for weight-only FP8 (served dequantized)."""

    method: str
    block_size: tuple[int, int] | None
    activation: str | None
    activation_scale_ub: float | None = None

    @property
    def weight_scale_names(self) -> tuple[str, ...]:
        return ("weight_scale_inv", "weight_scale") if self.method == "fp8" else ("weight_scale",)

    @property
    def input_scale_names(self) -> tuple[str, ...]:
        return ("input_scale", "activation_scale") if self.method == "fp8" else ("input_scale",)

    @classmethod
    def from_config(cls, quant: Any) -> Fp8CheckpointFormat | None:
        """The format of an HF config's ``quantization_config`` (a dict or transformers'
        object); None for none or a method a model reads itself. ``ValueError`` naming the
        field for anything not implemented."""
        if not quant:
            return None
        if not isinstance(quant, dict):
            quant = quant.to_dict()
        method = quant.get("quant_method")
        if method in MODEL_METHODS:
            return None
        if method == "fp8":
            return _fine_grained(quant)
        if method == "compressed-tensors":
            if not quant.get("config_groups") and quant.get("kv_cache_scheme"):
                check_keys(quant, CT_FIELDS)
                return None  # only the KV cache is quantized (kv_scales.py): dense weights
            return _compressed_tensors(quant)
        if method == "fbgemm_fp8":
            check_keys(quant, {"quant_method", "activation_scale_ub", "modules_to_not_convert"})
            ub = quant.get("activation_scale_ub")
            return cls("fbgemm_fp8", None, "token", None if ub is None else float(ub))
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not supported "
            f"(FP8 checkpoints: {', '.join(FP8_METHODS)})"
        )


def _fine_grained(q: dict) -> Fp8CheckpointFormat:
    known = {"quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert",
             "ignored_layers", "fmt", "scale_fmt", "expert_dtype", "modules_to_convert",
             "dequantize"}  # fmt: skip
    check_keys(q, known)
    for key, ok in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
        if q.get(key) not in (None, ok):
            raise bad_field(key, q[key], f"only {ok!r}")
    if q.get("modules_to_convert"):
        raise bad_field(
            "modules_to_convert", q["modules_to_convert"], "embeddings stay unquantized"
        )
    if q.get("dequantize"):
        raise bad_field("dequantize", q["dequantize"], "use --quantization fp32 to dequantize")
    scheme = q.get("activation_scheme", "dynamic")
    block = q.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) <= 0):
        raise bad_field("weight_block_size", block, "two positive integers")
    if scheme not in ("dynamic", "static") or (scheme == "static" and block is not None):
        raise bad_field("activation_scheme", scheme, "dynamic, or static with per-tensor scales")
    block = tuple(int(b) for b in block) if block is not None else None
    return Fp8CheckpointFormat("fp8", block, "static" if scheme == "static" else "token")


def _compressed_tensors(q: dict) -> Fp8CheckpointFormat:
    if q.get("format") not in (None, "float-quantized"):
        raise bad_field("format", q["format"], "only 'float-quantized' (FP8 weights)")
    group, where = compressed_tensors_group(q)
    if group.get("output_activations"):
        raise bad_field(
            where + "output_activations", group["output_activations"], "not implemented"
        )
    if group.get("format") not in (None, "float-quantized"):
        raise bad_field(where + "format", group["format"], "only 'float-quantized'")
    w = group.get("weights") or {}
    for key, ok in (("num_bits", 8), ("type", "float"), ("symmetric", True),
                    ("dynamic", False), ("group_size", None), ("actorder", None)):  # fmt: skip
        if w.get(key, ok) != ok:
            raise bad_field(f"{where}weights.{key}", w[key], f"only {ok!r}")
    strategy = w.get("strategy")
    block = None
    if strategy == "block":
        block = tuple(int(b) for b in w.get("block_structure") or ())
        if len(block) != 2:
            raise bad_field(f"{where}weights.block_structure", w.get("block_structure"), "2 ints")
    elif strategy not in ("tensor", "channel"):
        raise bad_field(f"{where}weights.strategy", strategy, "tensor, channel or block")
    return Fp8CheckpointFormat("compressed-tensors", block, _ct_activation(group, where))


def _ct_activation(group: dict, where: str) -> str | None:
    a = group.get("input_activations")
    if not a:
        return None  # weight-only
    for key, ok in (("num_bits", 8), ("type", "float"), ("symmetric", True),
                    ("group_size", None)):  # fmt: skip
        if a.get(key, ok) != ok:
            raise bad_field(f"{where}input_activations.{key}", a[key], f"only {ok!r}")
    key = (a.get("strategy"), bool(a.get("dynamic")))
    schemes = {("token", True): "token", ("tensor", True): "tensor", ("tensor", False): "static"}
    if key not in schemes:
        raise bad_field(f"{where}input_activations", a, "token/dynamic, tensor/dynamic or static")
    return schemes[key]


class _Fp8Weight(torch.Tensor):
    """A checkpoint's FP8 weight (out, in) with its scales (row scales (out,), or with
    ``block`` its block scales (ceil(out / b0), ceil(in / b1))) and static input scale, as
    a tensor the model's loader can ``torch.cat`` (along rows; block-scaled parts only
    where each but the last ends on a block) and ``copy_`` into a linear layer's weight:
    the copy writes the dequantized values and records, in ``sink``
    (``Fp8Loading.records``), the FP8 values and scales that reached that parameter. Any
    other use sees the dequantized weight (fp32)."""

    @staticmethod
    def __new__(cls, data, scale, input_scale, sink, block=None):
        t = torch.Tensor._make_subclass(cls, data)
        t.fp8, t.scale, t.input_scale, t.sink, t.block = data, scale, input_scale, sink, block
        return t

    def dequantized(self) -> torch.Tensor:
        if self.block is not None:
            return dequantize_fp8_blocks(self.fp8, self.scale, self.block)
        return self.fp8.float() * self.scale[:, None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if getattr(func, "__name__", "") in ("__get__", "size", "dim", "numel", "__len__"):
                return func(*args, **kwargs)  # metadata (shape, dtype...): the FP8 tensor's
            if func is torch.cat and cls._row_cat(args, kwargs):
                parts = args[0]
                scales = [p.input_scale for p in parts]
                return cls(
                    torch.cat([p.fp8 for p in parts]),
                    torch.cat([p.scale for p in parts]),
                    None if scales[0] is None else torch.stack(scales).amax(),
                    parts[0].sink,
                    parts[0].block,
                )
            if func is torch.Tensor.copy_ and isinstance(args[1], cls) and len(args) == 2:
                dst, src = args
                src.sink[id(dst)] = (dst, src.fp8, src.scale, src.input_scale)
                # An Fp8Linear's weight (planned by plan_fp8_linears) takes the stored bytes.
                return dst.copy_(src.fp8 if dst.dtype == FP8_DTYPE else src.dequantized())
            plain = tree_map(lambda t: t.dequantized() if isinstance(t, cls) else t, (args, kwargs))
            return func(*plain[0], **plain[1])

    @classmethod
    def _row_cat(cls, args, kwargs) -> bool:
        parts = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        static = {p.input_scale is None for p in parts if isinstance(p, cls)}
        same = len({id(p.sink) for p in parts if isinstance(p, cls)}) == 1
        if not (dim == 0 and all(isinstance(p, cls) for p in parts) and len(static) == 1):
            return False
        block = parts[0].block  # a block-scaled part ending inside a block: dequantized
        whole = block is None or all(p.shape[0] % block[0] == 0 for p in parts[:-1])
        return same and whole and len({p.block for p in parts}) == 1


@dataclass
class Fp8Loading:
    """An FP8 checkpoint being loaded: its format and, by ``id`` of the parameter each was
    copied into, (parameter, FP8 values, row scales, input scale) of its ``_Fp8Weight``s."""

    fmt: Fp8CheckpointFormat
    records: dict[int, tuple] = field(default_factory=dict)


def prepare_fp8_state(
    state: dict[str, torch.Tensor], fmt: Fp8CheckpointFormat | None, dtype: torch.dtype
) -> Fp8Loading | None:
    """Rewrite ``state`` in place for a dense model's loader: each FP8 weight and its scales
    become one tensor, weight-only per-tensor/channel ones dequantized to ``dtype``, the
    others (block-scaled ones included) an ``_Fp8Weight``. Returns what
    ``plan_fp8_linears`` and ``fill_fp8_linears`` read (None without a format).
    ``ValueError`` for FP8 tensors without a quantization_config or a scale."""
    names = [k for k, v in state.items() if v.dtype == FP8_DTYPE]
    if names and fmt is None:
        raise ValueError(f"{names[0]} is {FP8_DTYPE} but the config has no FP8 quantization_config")
    if fmt is None:
        return None
    loading = Fp8Loading(fmt)
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        weight = state[name]
        if leaf != "weight" or weight.dim() != 2:
            raise ValueError(f"FP8 tensor {name}: only 2-D linear weights are read as FP8")
        scale = _pop_any(state, prefix, fmt.weight_scale_names, name)
        input_scale = _pop_any(state, prefix, fmt.input_scale_names, None)
        if (input_scale is not None) != (fmt.activation == "static"):
            raise ValueError(
                f"{name}: activation scheme {fmt.activation!r} with "
                f"{'an' if input_scale is not None else 'no'} input scale in the checkpoint"
            )
        if fmt.block_size is not None:  # weight-only on the GPU (Fp8BlockLinear): no input scale
            _check_block_scale(weight, scale, fmt.block_size, name)
            state[name] = _Fp8Weight(weight, scale, input_scale, loading.records, fmt.block_size)
            continue
        rows = _row_scale(scale.float(), weight.shape[0], name)
        if fmt.activation is None:  # weight-only FP8: activations stay unquantized
            state[name] = (weight.float() * rows[:, None]).to(dtype)
        else:
            state[name] = _Fp8Weight(weight, rows, input_scale, loading.records)
    scales = (*fmt.weight_scale_names, *fmt.input_scale_names)
    stray = [k for k in state if k.rpartition(".")[2] in scales]
    if stray:  # a scale whose weight is not FP8: nothing would read it
        raise ValueError(f"{stray[0]}: a scale for a weight that is not {FP8_DTYPE}")
    return loading


def _pop_any(state: dict, prefix: str, names: tuple[str, ...], needed_by: str | None):
    for n in names:
        if f"{prefix}.{n}" in state:
            return state.pop(f"{prefix}.{n}").float()
    if needed_by is not None:
        raise ValueError(f"{needed_by} is FP8 but {prefix}.{names[0]} is missing")
    return None


def _row_scale(scale: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    if scale.numel() == 1:
        return scale.reshape(1).expand(rows).contiguous()
    if scale.numel() == rows and scale.shape[0] == rows:
        return scale.reshape(rows)
    raise ValueError(
        f"{name}: scale of shape {tuple(scale.shape)} is neither per tensor nor per row "
        f"({rows}); a block-scaled checkpoint names its weight_block_size"
    )


def _check_block_scale(weight, scale, block: tuple[int, int], name: str) -> None:
    expected = (math.ceil(weight.shape[0] / block[0]), math.ceil(weight.shape[1] / block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{name}: block scale of shape {tuple(scale.shape)} for a {tuple(weight.shape)} "
            f"weight in {list(block)} blocks (expected {expected})"
        )


# The block-wise dequantization, under its earlier name.
dequantize_blocks = dequantize_fp8_blocks


def plan_fp8_linears(model: nn.Module, state: dict, loading: Fp8Loading, device) -> int:
    """Before ``model`` (on the meta device) gets storage: run its ``load_weights`` on meta
    copies of ``state`` to learn which ``nn.Linear`` layers an ``_Fp8Weight`` fills whole,
    and make those (not ``KEEP_DENSE``, not a shape ``_scaled_mm`` refuses on ``device``)
    ``Fp8Linear`` shells, so their dense weights never exist on the device; block-scaled
    ones become ``Fp8BlockLinear`` where its kernel runs (``block_fp8_supported``: CUDA
    with triton), and elsewhere stay dense (their copies write dequantized values).
    Returns how many."""
    dry = Fp8Loading(loading.fmt)
    meta = {k: _meta_copy(v, dry.records) for k, v in state.items()}
    with torch.no_grad():
        model.load_weights(meta)
    device = torch.device(device)
    block = loading.fmt.block_size
    ok, why = block_fp8_supported(device)  # the Triton kernels: block layers and experts
    if ok and block is not None and triton_fp8_gemm.default_block_k(block) is None:
        ok, why = False, f"no K step of the kernel divides {list(block)} blocks"
    experts = _plan_fp8_experts(model, dry.records, block) if ok else 0
    if experts:
        logger.info("FP8 experts kept in FP8 in %d MoE layers", experts)
    if block is not None and not ok:
        logger.info("FP8 weights in %s blocks dequantized: %s", list(block), why)
        return 0

    def make(name: str, mod: nn.Module) -> nn.Module | None:
        record = dry.records.get(id(getattr(mod, "weight", None)))
        if not isinstance(mod, nn.Linear) or record is None or record[0] is not mod.weight:
            return None
        _, fp8, scale, input_scale = record
        if name.rpartition(".")[2] in KEEP_DENSE or fp8.shape != mod.weight.shape:
            return None
        if block is not None:
            return Fp8BlockLinear(fp8, scale, block, mod.bias)
        if not fp8_shape_ok(fp8, device):
            return None
        return Fp8Linear(fp8, scale, mod.bias, loading.fmt.activation, input_scale,
                         loading.fmt.activation_scale_ub)  # fmt: skip

    count = replace_linears(model, make)
    if block is not None:
        logger.info("FP8 weights in %s blocks: %d linear layers kept in FP8", list(block), count)
    return count


def _plan_fp8_experts(model: nn.Module, records: dict, block: tuple[int, int] | None) -> int:
    """Each ``FusedMoE`` whose every expert the dry run filled from ``_Fp8Weight``s (its
    gate and up into ``w13``, its down into ``w2``) and that can hold them
    (``fp8_unsupported_reason``) trades its dense weights for FP8 ones; returns how many."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    filled = Counter(id(r[0]._base) for r in records.values() if r[0]._base is not None)
    count = 0
    for name, mod in model.named_modules():
        if not isinstance(mod, FusedMoE) or mod.w13 is None:
            continue
        e = mod.num_experts
        if filled[id(mod.w13)] != 2 * e or filled[id(mod.w2)] != e:
            continue
        reason = mod.fp8_unsupported_reason(block)
        if reason is not None:
            logger.info("%s: FP8 experts dequantized (%s)", name, reason)
            continue
        mod.use_fp8_weights(block)
        count += 1
    return count


def _meta_copy(t: torch.Tensor, records: dict) -> torch.Tensor:
    if not isinstance(t, _Fp8Weight):
        return torch.empty_like(t, device="meta")
    scale = None if t.input_scale is None else torch.empty_like(t.input_scale, device="meta")
    return _Fp8Weight(
        torch.empty_like(t.fp8, device="meta"),
        torch.empty_like(t.scale, device="meta"),
        scale,
        records,
        t.block,
    )


def fill_fp8_linears(model: nn.Module, loading: Fp8Loading) -> int:
    """After ``load_weights``: each planned ``Fp8Linear`` (holding the stored FP8 bytes its
    ``_Fp8Weight`` copied in) takes that weight's scales (per row or per block) and input
    scale. A layer no
    ``_Fp8Weight`` filled, or filled with other bytes since, is a ``RuntimeError`` (a model
    loader that the plan misread). Returns how many layers."""
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    with torch.no_grad():
        for name, mod in layers:
            record = loading.records.get(id(mod.weight))
            if record is None or record[0] is not mod.weight:
                raise RuntimeError(f"{name}: planned as FP8 but no FP8 weight was copied in")
            _, fp8, scale, input_scale = record
            if not mod.weight.is_meta and not torch.equal(
                mod.weight.view(torch.uint8), fp8.to(mod.weight.device).view(torch.uint8)
            ):
                raise RuntimeError(f"{name}: its FP8 weight was overwritten after loading")
            mod.weight_scale.copy_(scale.reshape(mod.weight_scale.shape))
            if input_scale is not None and mod.input_scale is not None:
                mod.input_scale.copy_(input_scale.reshape(1, 1))
    return len(layers)
