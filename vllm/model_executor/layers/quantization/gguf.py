"""GGUF-quantized linear layers: the file's Q4_1 / Q8_0 blocks kept as they are.

A decode step reads every weight once; in fp32 that is 538 MB for SmolLM2-135M, in the
GGUF's own blocks (Q4_1: 5 bits a weight; its Q8_0 embedding: 8.5) about 96 MB. The
weights multiplied are exactly the fp32 reference's: both come from the same blocks and
the load checks that the blocks dequantize to the fp32 model's weights bit for bit.

Prefill (forwards of ``dense_min_tokens`` rows or more) dequantizes and runs a dense GEMM;
on a CPU with native bf16 arithmetic that GEMM runs in bf16 (inputs rounded to bf16, fp32
accumulation, output back to fp32), ``VLLM_CPU_GGUF_PREFILL_DTYPE`` deciding (see
``prefill_dtype``). An fp32 prefill on a CPU without AVX-512 never dequantizes: the AVX2
block kernel beats dequantization + torch's GEMM there at every size measured
(docs/kernels.md). Decode rows take the block kernel: 1-4 rows always with fp32
activations; 5+ rows with fp32, bf16 on AMX tiles (the default where the prefill is bf16
and the CPU has AMX-BF16) or int8 per 32-value block (``decode_act``,
``VLLM_CPU_GGUF_DECODE_ACT``).
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm import envs

logger = logging.getLogger(__name__)

SUPPORTED_TYPES = tuple(ops.GGML_BLOCK_BYTES)  # Q4_1, Q8_0
# From this many tokens on, dequantize + dense GEMM beats the AVX-512 block kernel (prefill).
DENSE_MIN_TOKENS = 48
NEVER_DENSE = sys.maxsize  # the block kernel at every size
PREFILL_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _cpu_capabilities() -> dict:
    """torch's cpuinfo flags (``avx512_bf16``, ``amx_bf16``...); empty on a torch without it."""
    return torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}


@functools.cache
def cpu_has_native_bf16() -> bool:
    """The CPU multiplies bf16 in hardware: CPUID's AVX512_BF16 (``vdpbf16ps``, Zen 4,
    Cooper Lake) or AMX-BF16 (Sapphire Rapids), as torch's cpuinfo reports them. Without
    either, oneDNN emulates bf16 on fp32 units (expected slower than fp32; not measured)."""
    caps = _cpu_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def prefill_dtype() -> torch.dtype:
    """The gguf path's prefill compute dtype: ``VLLM_CPU_GGUF_PREFILL_DTYPE`` (auto: bf16
    when ``cpu_has_native_bf16()``, else fp32). Raises ValueError on a bad value."""
    choice = envs.VLLM_CPU_GGUF_PREFILL_DTYPE
    if choice == "auto":
        choice = "bf16" if cpu_has_native_bf16() else "fp32"
    return PREFILL_DTYPES[choice]


def dense_min_tokens(dtype: torch.dtype) -> int:
    """From how many rows a forward dequantizes and runs a dense GEMM in ``dtype``: bf16
    always from ``DENSE_MIN_TOKENS``; fp32 only on AVX-512 CPUs, where torch's GEMM beats
    the block kernel's tile from there. On AVX2 CPUs the block kernel's panels beat
    dequantization + torch's fp32 GEMM at every size up to 2,048 rows (docs/kernels.md)."""
    if dtype != torch.float32 or torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return DENSE_MIN_TOKENS
    return NEVER_DENSE


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """The CPU has AMX tiles with bf16 products (Sapphire Rapids and later), as torch's
    cpuinfo reports it. (The kernel also needs the OS to lend the process the tile
    registers; where it refuses, the bf16 variant runs the fp32 kernel.)"""
    return bool(_cpu_capabilities().get("amx_bf16"))


def decode_act() -> str:
    """The block kernel's activation type for 5-47 rows: ``VLLM_CPU_GGUF_DECODE_ACT`` ("fp32",
    "int8" or "bf16"; auto: bf16 when the prefill runs in bf16 and the CPU has AMX-BF16, so
    pinning ``VLLM_CPU_GGUF_PREFILL_DTYPE=fp32`` keeps the whole path exact). Raises
    ValueError on a bad value."""
    choice = envs.VLLM_CPU_GGUF_DECODE_ACT
    if choice == "auto":
        choice = "bf16" if prefill_dtype() == torch.bfloat16 and cpu_has_amx_bf16() else "fp32"
    return choice


class GGUFLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W kept as GGUF blocks: uint8 (out, in / 32 * block).
    ``prefill_dtype``: the dense GEMM's dtype from ``dense_min_tokens`` rows on;
    ``decode_act``: the block kernel's activations below that ("fp32" or "int8")."""

    def __init__(
        self,
        qweight: torch.Tensor,
        qtype: int,
        bias: torch.Tensor | None,
        prefill_dtype: torch.dtype = torch.float32,
        decode_act: str = "fp32",
        dense_min_tokens: int = DENSE_MIN_TOKENS,
    ) -> None:
        super().__init__()
        if qtype not in SUPPORTED_TYPES:
            raise ValueError(f"GGML type {qtype} is not supported (supported: {SUPPORTED_TYPES})")
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.qtype = qtype
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] // ops.GGML_BLOCK_BYTES[qtype] * 32
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.prefill_dtype = prefill_dtype
        self.dense_min_tokens = dense_min_tokens
        if decode_act not in ops.DECODE_ACT_VARIANTS:
            raise ValueError(
                f"decode_act={decode_act!r}: expected one of {list(ops.DECODE_ACT_VARIANTS)}"
            )
        self.decode_act = decode_act
        # Dense (prefill) products stay in prefill_dtype: set on gate_up_proj when down_proj
        # takes them (bf16 silu_and_mul between the two GEMMs, ``keep_prefill_dtype_between``).
        self.keep_prefill_dtype = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)
        y = ops.ggml_linear(
            x,
            self.qweight,
            self.qtype,
            self.dense_min_tokens,
            self.prefill_dtype,
            self.decode_act,
            self.keep_prefill_dtype,
        )
        return y if self.bias is None else y + self.bias

    def dequantized_weight(self) -> torch.Tensor:
        return ops.ggml_dequantize(self.qweight, self.qtype)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, qtype={self.qtype}, "
            f"prefill_dtype={self.prefill_dtype}, dense_min_tokens={self.dense_min_tokens}, "
            f"decode_act={self.decode_act}, "
            f"keep_prefill_dtype={self.keep_prefill_dtype}"
        )


def unpermute_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (GGUF stores each head's rotary
    halves interleaved: HF row ``h*hd + s*hd/2 + j`` sits at GGUF row ``h*hd + 2*j + s``).
    Rows are whole blocks, so permuting rows of blocks is exact."""
    half = n_rows // n_heads // 2
    return torch.arange(n_rows).view(n_heads, half, 2).transpose(1, 2).reshape(n_rows)


class GGUFTensors:
    """The raw blocks of a GGUF file, by tensor name (``blk.0.attn_q.weight``)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in reader.tensors}
        arch = reader.fields.get("general.architecture")
        self.arch = bytes(arch.parts[-1]).decode() if arch is not None else ""

    def qtype(self, name: str) -> int:
        return int(self.tensors[name].tensor_type)

    def blocks(self, name: str, perm: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 (rows, row_bytes), copied out of the memory map."""
        data = torch.from_numpy(self.tensors[name].data.copy())
        return data if perm is None else data[perm]


def _fused_module(
    g: GGUFTensors,
    parts: list[tuple[str, torch.Tensor | None]],
    old: nn.Linear,
    dtype: torch.dtype,
    act: str = "fp32",
    dense_from: int = DENSE_MIN_TOKENS,
) -> GGUFLinear | None:
    """One GGUFLinear over the row-concatenated tensors ``parts`` (name, row order), or None
    when a part is missing or not of one supported type (the fp32 module then stays)."""
    if any(name not in g.tensors for name, _ in parts):
        return None
    qtypes = {g.qtype(name) for name, _ in parts}
    if len(qtypes) != 1 or not qtypes <= set(SUPPORTED_TYPES):
        return None
    qweight = torch.cat([g.blocks(name, perm) for name, perm in parts])
    new = GGUFLinear(qweight, qtypes.pop(), old.bias, dtype, act, dense_from)
    # The fp32 model was dequantized from these very blocks: anything but bit-equality
    # means a layout mistake (row order, fusing), so refuse rather than run wrong weights.
    if old.weight.dtype == torch.float32 and not torch.equal(new.dequantized_weight(), old.weight):
        raise ValueError(f"GGUF blocks of {[n for n, _ in parts]} do not match the fp32 weights")
    return new


def model_prefill_dtype(model: nn.Module) -> torch.dtype | None:
    """The prefill dtype of ``model``'s GGUF linear layers (None: not quantized)."""
    return next((m.prefill_dtype for m in model.modules() if isinstance(m, GGUFLinear)), None)


def keep_prefill_dtype_between(first: nn.Module, second: nn.Module) -> bool:
    """Let ``first``'s dense products stay in the prefill dtype when ``second`` (after an
    elementwise op that keeps the dtype, e.g. ``silu_and_mul``) is a GGUFLinear computing in
    that same dtype: the round trip through fp32 between the two GEMMs is skipped, with the
    same numbers (the elementwise op computes in fp32 and rounds once, where ``second``
    would round its fp32 input). Returns whether it was set."""
    ok = (
        isinstance(first, GGUFLinear)
        and isinstance(second, GGUFLinear)
        and first.bias is None
        and first.prefill_dtype == second.prefill_dtype != torch.float32
    )
    if ok:
        first.keep_prefill_dtype = True
    return ok


@dataclass(frozen=True)
class GGUFLayout:
    """Where a model class's linear layers are in a llama.cpp GGUF: data the model class
    declares as ``gguf_layout`` (``models/registry.py``), so this file names no
    architecture. The model has ``layers`` (its decoder layers) and ``lm_head``.

    ``layer_tensors``: an attribute of each decoder layer -> the GGUF tensors
    (``blk.{i}.<name>.weight``) whose rows it concatenates, in order.
    ``head_tensors``: ``lm_head``'s tensor, the first the file has (``token_embd`` when
    the embeddings are tied).
    ``permuted``: llama.cpp ``general.architecture`` -> the tensors its converter stored
    with each head's rotary halves interleaved (``unpermute_rows`` undoes it), each with
    the ``model.arch`` field that holds its head count.
    ``elementwise_pairs``: (first, second) layer attributes with only an elementwise op
    between them (``keep_prefill_dtype_between``).
    """

    layer_tensors: dict[str, tuple[str, ...]]
    head_tensors: tuple[str, ...] = ("output", "token_embd")
    permuted: dict[str, dict[str, str]] = field(default_factory=dict)
    elementwise_pairs: tuple[tuple[str, str], ...] = ()

    def plan(self, model: nn.Module, g: GGUFTensors) -> list[tuple[nn.Module, str, list]]:
        """(parent module, attribute, [(GGUF tensor name, row order or None)]) for every
        linear layer of ``model``, in the file's order: layer by layer, then the head."""
        perms = {}
        for name, heads_field in self.permuted.get(g.arch, {}).items():
            n_heads = getattr(model.arch, heads_field)
            perms[name] = unpermute_rows(n_heads * model.arch.head_dim, n_heads)
        plan: list[tuple[nn.Module, str, list]] = []
        for i, layer in enumerate(model.layers):
            for attr, names in self.layer_tensors.items():
                parts = [(f"blk.{i}.{name}.weight", perms.get(name)) for name in names]
                plan.append((layer, attr, parts))
        present = [t for t in self.head_tensors if f"{t}.weight" in g.tensors]
        head = (present or list(self.head_tensors))[0]
        plan.append((model, "lm_head", [(f"{head}.weight", None)]))
        return plan


def model_gguf_layout(model: nn.Module) -> GGUFLayout:
    layout = getattr(type(model), "gguf_layout", None)
    if layout is None:
        raise ValueError(
            f"{type(model).__name__} declares no gguf_layout: --quantization gguf is not "
            "supported for it (use --quantization fp32)"
        )
    return layout


def apply_gguf_quantization(model: nn.Module, path: str | Path) -> dict[str, int]:
    """Replace ``model``'s linear layers (as its class's ``gguf_layout`` places them) by
    GGUFLinear over the blocks of the GGUF at ``path``. Returns counts: ``quantized`` /
    ``kept_fp32`` modules. The prefill dtype (``prefill_dtype()``) and decode activations
    (``decode_act()``) are fixed here, once per load."""
    layout = model_gguf_layout(model)
    if model_prefill_dtype(model) is not None:
        raise ValueError("the model's linear layers are GGUF blocks already")
    dtype, act = prefill_dtype(), decode_act()
    dense_from = dense_min_tokens(dtype)
    g = GGUFTensors(path)
    counts = {"quantized": 0, "kept_fp32": 0}
    for parent, attr, parts in layout.plan(model, g):
        new = _fused_module(g, parts, getattr(parent, attr), dtype, act, dense_from)
        if new is None:
            counts["kept_fp32"] += 1
            logger.info("Keeping %s in fp32 (no supported GGUF blocks)", parts[0][0])
            continue
        setattr(parent, attr, new)
        counts["quantized"] += 1
    if dtype != torch.float32:
        for layer in model.layers:
            for first, second in layout.elementwise_pairs:
                keep_prefill_dtype_between(getattr(layer, first), getattr(layer, second))
    prefill = (
        "the block kernel at every size"
        if dense_from == NEVER_DENSE
        else f"a dense {dtype} GEMM from {dense_from} tokens per forward"
    )
    logger.info("GGUF prefill: %s; decode activations in %s", prefill, act)
    return counts


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights a decode step reads: every linear layer's weight (blocks or dense);
    the embedding table is only gathered from, so it is not counted."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, GGUFLinear):
            total += mod.qweight.numel()
        elif isinstance(mod, nn.Linear):
            total += mod.weight.numel() * mod.weight.element_size()
    return total
