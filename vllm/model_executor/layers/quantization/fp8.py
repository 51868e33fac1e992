"""FP8 linear layers: float8_e4m3fn weights with one fp32 scale per output channel,
multiplied in FP8 (``Fp8Linear``: vLLM's W8A8 FP8 with dynamic per-token activations).

Where they come from: an FP8 checkpoint whose scales are per tensor, per channel or per row
(``fp8_checkpoint.py``: its stored FP8 values and scales, never re-quantized), or
``--quantization fp8`` on a bf16/fp16/fp32 model (``quantize_model_fp8``: each weight row
scaled by its absmax / 448). A per-tensor scale is a per-channel scale whose values are
equal, so fused layers (q/k/v, gate/up) of per-tensor checkpoints stay exact.

The forward quantizes each activation row by its own absmax / 448 (or a static per-tensor
input scale where the checkpoint gives one) and calls ``torch._scaled_mm`` with row-wise
scales: no host read, so decode steps replay in CUDA graphs. It runs on this torch's CPU
and on CUDA devices of compute capability 8.9 and up (Ada, Hopper); ``fp8_supported``.

Block-scaled checkpoints (one scale per 128 x 128 block: DeepSeek-V3, Qwen3-*-FP8) keep
their FP8 weights on CUDA in ``Fp8BlockLinear``: weight-only, the weight widened in
registers by the Triton GEMM of ``triton_fp8_gemm.py``; elsewhere they are dequantized.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from vllm.model_executor.layers import triton_fp8_gemm

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The smallest scale used (vLLM's floor): an all-zero row quantizes to zeros, not NaNs.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
# Activation scaling of an Fp8Linear: each row's absmax ("token"), the whole input's
# ("tensor"), or the checkpoint's static per-tensor input scale ("static").
ACTIVATION_SCHEMES = ("token", "tensor", "static")
# On CUDA, torch._scaled_mm wants both GEMM dimensions divisible by 16.
CUDA_ALIGNMENT = 16


def fp8_supported(device: torch.device | str) -> tuple[bool, str]:
    """(whether ``torch._scaled_mm`` multiplies FP8 on ``device``, why not)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True, ""
    if device.type != "cuda":
        return False, f"no FP8 GEMM on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return False, f"compute capability {major}.{minor} < 8.9 has no FP8 tensor cores"
    return True, ""


def quantize_fp8_rows(
    x: torch.Tensor, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (rows, k) -> (FP8 values, fp32 scales (rows, 1)), ``x ~ values * scales``: each
    row scaled by its absmax / 448 (the absmax capped at ``scale_ub`` first, fbgemm's
    ``activation_scale_ub``). No host read."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub)
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return _to_fp8(x, scale), scale


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


class Fp8Linear(nn.Module):
    """``y = x @ (weight * weight_scale)^T + bias``, multiplied in FP8, ``y`` in ``x``'s dtype.

    ``weight`` (out, in) float8_e4m3fn and ``weight_scale`` (out,) fp32 are buffers kept in
    their dtypes by ``Module.to(dtype)`` (only moved); ``bias`` is a parameter in the
    model's dtype. ``input_scale`` (a scalar fp32 tensor) with ``activation="static"``;
    ``activation_scale_ub`` caps the per-row absmax (fbgemm)."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str = "token",
        input_scale: torch.Tensor | None = None,
        activation_scale_ub: float | None = None,
    ) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8Linear takes a 2-D {FP8_DTYPE} weight, got {weight.dtype}")
        if weight_scale.numel() != weight.shape[0]:
            raise ValueError(
                f"weight_scale has {weight_scale.numel()} values for {weight.shape[0]} rows"
            )
        if activation not in ACTIVATION_SCHEMES:
            raise ValueError(f"activation {activation!r} is not one of {ACTIVATION_SCHEMES}")
        if (activation == "static") != (input_scale is not None):
            raise ValueError("an input_scale goes with activation='static' and only with it")
        self.out_features, self.in_features = weight.shape
        self.activation = activation
        self.activation_scale_ub = activation_scale_ub
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.reshape(1, -1).float().contiguous())
        if input_scale is not None:
            input_scale = input_scale.reshape(1, 1).float().to(weight.device)
        self.register_buffer("input_scale", input_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_dense(cls, linear: nn.Linear) -> Fp8Linear:
        """``--quantization fp8``: ``linear``'s weight quantized per output channel."""
        weight, scale = quantize_fp8_rows(linear.weight.detach())
        return cls(weight, scale.flatten(), linear.bias)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """(out, in) ``weight * weight_scale`` in ``dtype`` (computed in fp32)."""
        return (self.weight.float() * self.weight_scale.t()).to(dtype)

    def to_dense(self, dtype: torch.dtype) -> nn.Linear:
        """An ``nn.Linear`` of the dequantized weight (exact: the FP8 checkpoint's values)."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = nn.Parameter(self.dequantized_weight(dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        return linear

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, in) activations -> (FP8 values, fp32 scales (rows, 1)), by ``activation``."""
        if self.activation == "token":
            return quantize_fp8_rows(x, self.activation_scale_ub)
        if self.activation == "tensor":
            scale = (x.abs().amax().float() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1, 1)
        else:
            scale = self.input_scale
        return _to_fp8(x, scale), scale.expand(x.shape[0], 1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        q, scale = self.quantize_input(x.reshape(-1, self.in_features))
        # CUDA's row-wise scaled GEMM writes bf16 only; the CPU's writes any float dtype.
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        y = torch._scaled_mm(
            q, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=out_dtype
        ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _apply(self, fn, recurse: bool = True):
        # Module.to(dtype) casts every floating-point tensor, FP8 ones included: the FP8
        # weight and the fp32 scales only follow device moves. A zero-size probe tells a
        # cast (never applied to them, not even transiently) from a move or to_empty.
        probe = fn(torch.empty(0, dtype=FP8_DTYPE, device=self.weight.device))
        if probe.dtype == FP8_DTYPE:
            return super()._apply(fn, recurse)
        buffers = dict(self._buffers)
        self._buffers.clear()
        super()._apply(fn, recurse)  # the bias
        for name, buf in buffers.items():
            self._buffers[name] = None if buf is None else buf.to(probe.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, activation={self.activation}"
        )


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``weight`` (out, in) FP8 times ``scale`` (ceil(out / b0), ceil(in / b1)) per block,
    in fp32. ``ValueError`` for a scale of another shape."""
    out, inp = weight.shape
    expected = (math.ceil(out / block[0]), math.ceil(inp / block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"block scale of shape {tuple(scale.shape)} for a {tuple(weight.shape)} weight "
            f"in {list(block)} blocks (expected {expected})"
        )
    full = scale.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return weight.float() * full


def block_fp8_supported(device: torch.device | str) -> tuple[bool, str]:
    """(whether ``Fp8BlockLinear``'s Triton kernel runs on ``device``, why not). CUDA
    only: on the CPU a dense GEMM of the dequantized weight is faster."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"the block-scaled FP8 GEMM is a CUDA kernel, not for {device.type}"
    reason = triton_fp8_gemm.triton_unavailable_reason(device)
    return reason is None, reason or ""


class Fp8BlockLinear(Fp8Linear):
    """``y = x @ (weight * weight_scale per block)^T + bias``, ``y`` in ``x``'s dtype, from
    a block-scaled checkpoint's ``weight`` (out, in) float8_e4m3fn and ``weight_scale``
    (ceil(out / b0), ceil(in / b1)) fp32, kept as stored. Weight-only (W8A16): ``x`` is
    not quantized; ``triton_fp8_gemm.fp8_block_linear`` widens the weight in registers
    (CUDA; ``block_fp8_supported``). An ``Fp8Linear`` for the loader and
    ``dequantize_model_fp8``; its buffers keep their dtypes through ``Module.to(dtype)``."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        block_size: tuple[int, int],
        bias: torch.Tensor | None = None,
    ) -> None:
        nn.Module.__init__(self)
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8BlockLinear takes a 2-D {FP8_DTYPE} weight, got {weight.dtype}")
        block_size = (int(block_size[0]), int(block_size[1]))
        if triton_fp8_gemm.default_block_k(block_size) is None or block_size[0] <= 0:
            raise ValueError(f"block_size {list(block_size)}: columns must be a multiple of 16")
        out, inp = weight.shape
        expected = (-(-out // block_size[0]), -(-inp // block_size[1]))
        if tuple(weight_scale.shape) != expected:
            raise ValueError(
                f"weight_scale of shape {tuple(weight_scale.shape)} for a {(out, inp)} weight "
                f"in {list(block_size)} blocks (expected {expected})"
            )
        self.out_features, self.in_features = out, inp
        self.block_size = block_size
        self.activation, self.activation_scale_ub = None, None  # weight-only
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.register_buffer("input_scale", None)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_blocks(self.weight, self.weight_scale, self.block_size).to(dtype)

    def quantize_input(self, x: torch.Tensor):
        raise NotImplementedError("Fp8BlockLinear is weight-only: its input is not quantized")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = triton_fp8_gemm.fp8_block_linear(
            x.reshape(-1, self.in_features).contiguous(),
            self.weight,
            self.weight_scale,
            self.block_size,
            None if self.bias is None else self.bias.to(x.dtype),
        )
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, block_size={list(self.block_size)} (weight-only)"
        )


def fp8_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of FP8 weights and their scales, bytes of dense linear weights) in ``model``;
    a ``FusedMoE``'s experts count as either."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    fp8 = dense = 0
    for mod in model.modules():
        if isinstance(mod, Fp8Linear):
            fp8 += mod.weight.numel() + mod.weight_scale.numel() * 4
        elif isinstance(mod, nn.Linear):
            dense += mod.weight.numel() * mod.weight.element_size()
        elif isinstance(mod, FusedMoE) and mod.fp8:
            fp8 += sum(getattr(mod, n).numel() * getattr(mod, n).element_size()
                       for n in ("w13_weight", "w13_scale", "w2_weight", "w2_scale"))  # fmt: skip
        elif isinstance(mod, FusedMoE) and mod.w13 is not None:
            dense += (mod.w13.numel() + mod.w2.numel()) * mod.w13.element_size()
    return fp8, dense


# Linear layers kept dense by --quantization fp8, as vLLM keeps them: the output head and
# the MoE routers (read as weights by some models, and small).
KEEP_DENSE = ("lm_head", "gate", "shared_expert_gate")


def replace_linears(model: nn.Module, make) -> int:
    """Replace each submodule for which ``make(name, module)`` returns a module; returns how
    many were replaced."""
    count = 0
    for name, mod in list(model.named_modules()):
        new = make(name, mod)
        if new is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
        count += 1
    return count


def quantize_model_fp8(model: nn.Module) -> int:
    """``--quantization fp8``: every ``nn.Linear`` but ``KEEP_DENSE`` (and, on CUDA, those
    whose shape ``_scaled_mm`` refuses) becomes an ``Fp8Linear`` of its weight quantized per
    output channel. Returns how many layers were quantized."""

    def make(name: str, mod: nn.Module) -> nn.Module | None:
        if not isinstance(mod, nn.Linear) or name.rpartition(".")[2] in KEEP_DENSE:
            return None
        if not fp8_shape_ok(mod.weight):
            return None
        return Fp8Linear.from_dense(mod)

    with torch.no_grad():
        return replace_linears(model, make)


def fp8_shape_ok(weight: torch.Tensor, device: torch.device | None = None) -> bool:
    """Whether ``torch._scaled_mm`` takes a weight of this shape on ``device`` (default:
    the weight's)."""
    if (device or weight.device).type != "cuda":
        return True
    return all(n % CUDA_ALIGNMENT == 0 for n in weight.shape)


def dequantize_model_fp8(model: nn.Module, dtype: torch.dtype) -> int:
    """Every ``Fp8Linear`` back to an ``nn.Linear`` of its dequantized weight in ``dtype``
    and every ``FusedMoE``'s FP8 experts to dense ones (exact); returns how many layers."""
    from vllm.model_executor.layers.fused_moe import FusedMoE

    with torch.no_grad():
        experts = [m for m in model.modules() if isinstance(m, FusedMoE) and m.fp8]
        for moe in experts:
            moe.dequantize_fp8_weights(dtype)
        return len(experts) + replace_linears(
            model, lambda _, mod: mod.to_dense(dtype) if isinstance(mod, Fp8Linear) else None
        )
