"""Mixture-of-experts feed-forward over a flat batch of tokens, as vLLM's ``FusedMoE``.

A router scores every expert for every token; each token goes to its ``top_k`` experts,
each a gated MLP, and its output is their sum weighted by the router's probabilities.
Every expert's weights live stacked in two parameters::

    w13  (num_experts, 2 * intermediate, hidden)   [gate; up], as one linear layer
    w2   (num_experts, hidden, intermediate)       down

The gate is SiLU (``activation="silu"``), or gpt-oss's clamped SwiGLU (``"swigluoai"``,
vLLM's name: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``),
whose experts also add biases (``has_bias``: ``w13_bias (num_experts, 2 * intermediate)``,
``w2_bias (num_experts, hidden)``).

The experts run as two grouped GEMMs (``torch.nn.functional.grouped_mm``) over the
``num_tokens * top_k`` (token, expert) pairs sorted by expert: one kernel per projection
whatever the number of experts hit, and the group offsets are a tensor counted on the
device, so a decode step has no host sync and replays in a CUDA graph. Where the
grouped GEMM does not take the operands (CUDA in fp16 or fp32, rows not 16-byte aligned),
a loop over the experts hit does the same products, one pair of GEMMs each; that loop
reads the group sizes on the host, so under CUDA-graph capture it computes every expert
for every token instead (exact, ``num_experts / top_k`` times the work).

``FusedMoE(..., mxfp4=True)`` (gpt-oss on CUDA) holds the experts packed as MXFP4
checkpoints store them, in buffers instead of ``w13`` / ``w2``::

    w13_blocks (num_experts, 2 * intermediate, hidden / 32, 16)  uint8, two E2M1 a byte
    w13_scales (num_experts, 2 * intermediate, hidden / 32)      uint8, E8M0
    w2_blocks  (num_experts, hidden, intermediate / 32, 16), w2_scales likewise

and the two grouped GEMMs are the Triton kernel of ``triton_mxfp4_moe.py``, which expands
each weight tile in registers and adds the biases (a fixed grid: CUDA graphs capture it).

``use_fp8_weights(block_size)`` (an FP8 checkpoint's experts on CUDA, planned by
``fp8_checkpoint.py``) holds them as the checkpoint stores them, float8_e4m3fn with fp32
scales per block (``block_size``) or per row (per-tensor and per-channel checkpoints)::

    w13_weight (num_experts, 2 * intermediate, hidden)  w13_scale (E, 2I / b0, hidden / b1)
    w2_weight  (num_experts, hidden, intermediate)      w2_scale  (E, hidden / b0, I / b1)

(per row: ``(E, rows, 1)``), and both grouped GEMMs are ``triton_fp8_gemm``'s grouped
kernel, weight-only: the activations stay in the model's dtype.

``use_int4_weights(group_size)`` (a 4-bit AWQ / GPTQ / compressed-tensors checkpoint's
experts on CUDA, planned by ``int4.plan_int4_linears``) holds them packed in the layout
``Int4Linear`` holds (``triton_w4a16.py``; ``K`` each projection's inputs, ``G`` its
groups)::

    w13_qweight (E, hidden / 8, 2 * intermediate) int32   w13_scales / w13_zeros (E, G, 2I)
    w2_qweight  (E, intermediate / 8, hidden)     int32   w2_scales / w2_zeros   (E, G, hidden)

(scales fp32, zeros uint8), and both grouped GEMMs are ``triton_w4a16``'s grouped kernel.
GPTQ act-order experts (a permutation of each expert's inputs) are not held so.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm import _custom_ops as ops
from vllm.model_executor.layers import triton_fp8_gemm, triton_mxfp4_moe, triton_w4a16
from vllm.model_executor.layers.quantization.fp8 import FP8_DTYPE, dequantize_fp8_blocks

FP8_BUFFERS = ("w13_weight", "w13_scale", "w2_weight", "w2_scale")
INT4_BUFFERS = tuple(f"{w}_{t}" for w in ("w13", "w2") for t in ("qweight", "scales", "zeros"))

_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(
    torch, "_grouped_mm", None
)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, expert ids int64), each ``(num_tokens, top_k)``: the ``top_k`` largest
    softmax probabilities of each row (softmax in fp32 over all experts), divided by their
    sum when ``renormalize`` (Mixtral always; Qwen MoE when ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts_grouped(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3-style routing (GLM-4.5's): sigmoid scores; the experts are chosen by
    score plus ``correction_bias`` among the ``topk_groups`` groups (of ``num_groups``)
    whose two best experts score highest, weighted by their plain scores (divided by their
    sum when ``renormalize``), times ``scaling``. (weights fp32, ids int64). ``scoring``
    "softmax" (Mistral 4's, no bias: ``correction_bias`` None): the scores are the
    softmax over all experts, the groups ranked the same way by their two best."""
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        grouped = choice.view(choice.shape[0], num_groups, -1)
        best_groups = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices
        keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), -torch.inf)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def grouped_mm_supported(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the grouped GEMM takes ``a (rows, K)`` against ``w (groups, N, K)``: on
    the CPU any float dtype, on CUDA bf16 from sm80; every row 16-byte aligned."""
    if _GROUPED_MM is None or a.dtype != w.dtype:
        return False
    if (a.shape[-1] * a.element_size()) % 16 or (w.shape[1] * w.element_size()) % 16:
        return False
    if a.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    if w.device.type == "cuda":
        return w.dtype == torch.bfloat16 and torch.cuda.get_device_capability(w.device) >= (8, 0)
    return w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)


def _grouped_linear(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a`` rows ``[offs[g-1], offs[g])`` times ``w[g].T``, for every group ``g``:
    ``(rows, K) x (groups, N, K) -> (rows, N)``."""
    if grouped_mm_supported(a, w):
        return _GROUPED_MM(a, w.transpose(1, 2), offs=offs)
    out = a.new_empty(a.shape[0], w.shape[1])
    start = 0
    for group, end in enumerate(offs.tolist()):  # host sync: the eager fallback only
        if end > start:
            torch.mm(a[start:end], w[group].t(), out=out[start:end])
        start = end
    return out


def swiglu_oai(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gate over ``h (rows, 2I)`` = [gate | up]: ``(rows, I)``, in fp32 inside."""
    gate, up = h.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1) * gate * torch.sigmoid(gate * alpha)).to(h.dtype)


class Activation:
    """The experts' activation: gated over [gate | up] halves (SiLU, or gpt-oss's clamped
    SwiGLU), or Nemotron-H's ReLU squared over the whole width (``relu2``: no gate, the
    first weights are the up projection alone)."""

    def __init__(self, name: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> None:
        if name not in ("silu", "swigluoai", "relu2"):
            raise ValueError(f"activation {name!r} is not supported (silu, swigluoai, relu2)")
        self.name, self.alpha, self.limit = name, alpha, limit

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.name == "silu":
            return ops.silu_and_mul(h)
        if self.name == "relu2":
            return torch.relu(h).square()
        return swiglu_oai(h, self.alpha, self.limit)


SILU = Activation()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """(order, ends) of the ``num_tokens * top_k`` (token, expert) pairs, pair
    ``p = token * top_k + slot``: the pairs sorted by expert, and each expert's end in that
    order (int32, counted on the device)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts.cumsum(0, dtype=torch.int32)


def _combine(y: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """``y (pairs, hidden)`` sorted by expert -> ``(num_tokens, hidden)``: each token's
    pairs summed with ``topk_weights`` in fp32, in ``y``'s dtype."""
    num_tokens, top_k = topk_weights.shape
    by_pair = torch.empty_like(y).index_copy_(0, order, y)  # back in token order
    out = torch.bmm(  # (num_tokens, 1, top_k) x (num_tokens, top_k, hidden)
        topk_weights.unsqueeze(1), by_pair.view(num_tokens, top_k, -1).float()
    )
    return out.view(num_tokens, -1).to(y.dtype)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: Activation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(num_tokens, hidden)``: each row of ``x`` through its experts ``topk_ids``, summed
    with ``topk_weights`` (fp32, accumulated in fp32)."""
    top_k = topk_ids.shape[1]
    biases = (w13_bias, w2_bias)
    if not grouped_mm_supported(x, w13) and _capturing(x.device):
        return _dense_experts(x, w13, w2, topk_weights, topk_ids, activation, *biases)
    order, offs = _sort_by_expert(topk_ids, w13.shape[0])
    h = _grouped_linear(x.index_select(0, order // top_k), w13, offs)  # (pairs, 2I)
    has_bias = w13_bias is not None or w2_bias is not None
    # each sorted pair's expert, for the biases
    experts = topk_ids.reshape(-1).index_select(0, order) if has_bias else None
    if w13_bias is not None:
        h = h + w13_bias.index_select(0, experts)
    y = _grouped_linear(activation(h), w2, offs)  # (pairs, hidden), by expert
    if w2_bias is not None:
        y = y + w2_bias.index_select(0, experts)
    return _combine(y, order, topk_weights)


def fused_experts_mxfp4(
    x: torch.Tensor,
    moe: FusedMoE,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``fused_experts`` over ``moe``'s packed MXFP4 experts: both grouped GEMMs (biases
    included) in ``triton_mxfp4_moe``'s kernel. No host sync, fixed launch shapes."""
    top_k = topk_ids.shape[1]
    order, ends = _sort_by_expert(topk_ids, moe.num_experts)
    linear = triton_mxfp4_moe.mxfp4_grouped_linear
    h = linear(  # (pairs, 2I), by expert
        x.index_select(0, order // top_k), moe.w13_blocks, moe.w13_scales, ends, moe.w13_bias
    )
    y = linear(moe.activation(h), moe.w2_blocks, moe.w2_scales, ends, moe.w2_bias)
    return _combine(y, order, topk_weights)


def fused_experts_fp8(
    x: torch.Tensor,
    moe: FusedMoE,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``fused_experts`` over ``moe``'s FP8 experts: both grouped GEMMs in
    ``triton_fp8_gemm``'s grouped kernel. No host sync, fixed launch shapes."""
    top_k = topk_ids.shape[1]
    order, ends = _sort_by_expert(topk_ids, moe.num_experts)
    linear = triton_fp8_gemm.fp8_grouped_linear
    h = linear(  # (pairs, 2I), by expert
        x.index_select(0, order // top_k), moe.w13_weight, moe.w13_scale, moe.fp8_block, ends
    )
    y = linear(moe.activation(h), moe.w2_weight, moe.w2_scale, moe.fp8_block, ends)
    return _combine(y, order, topk_weights)


def fused_experts_int4(
    x: torch.Tensor,
    moe: FusedMoE,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``fused_experts`` over ``moe``'s packed 4-bit experts: both grouped GEMMs in
    ``triton_w4a16``'s grouped kernel. No host sync, fixed launch shapes."""
    top_k = topk_ids.shape[1]
    order, ends = _sort_by_expert(topk_ids, moe.num_experts)
    linear = triton_w4a16.w4a16_grouped_linear
    g13, g2 = moe.int4_group
    h = linear(  # (pairs, 2I), by expert
        x.index_select(0, order // top_k), moe.w13_qweight, moe.w13_scales, moe.w13_zeros,
        g13, ends,
    )  # fmt: skip
    y = linear(moe.activation(h).contiguous(), moe.w2_qweight, moe.w2_scales, moe.w2_zeros,
               g2, ends)  # fmt: skip
    return _combine(y, order, topk_weights)


def _dense_experts(
    x, w13, w2, topk_weights, topk_ids, activation=SILU, w13_bias=None, w2_bias=None
) -> torch.Tensor:
    """Every expert on every token, each weighted by its routing weight (zero where not
    chosen): fixed shapes and no host sync, for CUDA-graph capture without grouped GEMM."""
    num_experts = w13.shape[0]
    dense = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights)  # (num_tokens, num_experts)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        h = torch.mm(x, w13[e].t())
        if w13_bias is not None:
            h = h + w13_bias[e]
        y = torch.mm(activation(h), w2[e].t())
        if w2_bias is not None:
            y = y + w2_bias[e]
        out.add_(y.float() * dense[:, e : e + 1])
    return out.to(x.dtype)


class FusedMoE(nn.Module):
    """The routed experts of one layer: ``forward(x, router_logits)`` ->
    ``(num_tokens, hidden)``. Parameters ``w13`` and ``w2`` as the module docstring lays out,
    or with ``mxfp4`` the packed buffers (``use_dense_weights`` trades them for ``w13`` /
    ``w2``); ``load_expert`` fills one expert from a checkpoint's gate/up/down tensors."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        activation: Activation = SILU,
        has_bias: bool = False,
        mxfp4: bool = False,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        group = triton_mxfp4_moe.MXFP4_GROUP
        if mxfp4 and (hidden_size % group or intermediate_size % group):
            raise ValueError(
                f"mxfp4 experts need hidden_size ({hidden_size}) and intermediate_size "
                f"({intermediate_size}) in multiples of {group}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.mxfp4 = mxfp4
        self.fp8 = False  # use_fp8_weights
        self.fp8_block: tuple[int, int] | None = None
        self.int4_group: tuple[int, int] | None = None  # use_int4_weights: (w13's, w2's)
        self.w13 = self.w2 = None
        if mxfp4:
            for name, rows, cols in (
                ("w13", 2 * intermediate_size, hidden_size),
                ("w2", hidden_size, intermediate_size),
            ):
                shape = (num_experts, rows, cols // group)
                self.register_buffer(name + "_blocks", torch.empty(*shape, group // 2,
                                                                   dtype=torch.uint8))  # fmt: skip
                self.register_buffer(name + "_scales", torch.empty(shape, dtype=torch.uint8))
        else:
            self._make_dense_weights()
        self.w13_bias = self.w2_bias = None
        if has_bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def _make_dense_weights(self, **kwargs) -> None:
        e, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, **kwargs))
        self.w2 = nn.Parameter(torch.empty(e, h, i, **kwargs))

    def use_dense_weights(self, dtype: torch.dtype) -> None:
        """Trade the packed buffers for empty ``w13`` / ``w2`` in ``dtype`` on their device
        (where the kernel cannot run, or the checkpoint's experts are not MXFP4)."""
        if not self.mxfp4:
            return
        device = self.w13_blocks.device
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
            delattr(self, name)
        self.mxfp4 = False
        self._make_dense_weights(dtype=dtype, device=device)

    def fp8_unsupported_reason(self, block_size: tuple[int, int] | None) -> str | None:
        """Why ``use_fp8_weights(block_size)`` cannot hold these experts (None: it can)."""
        if self.mxfp4 or self.fp8 or self.w13_bias is not None:
            return "packed or biased experts"
        if block_size is None:
            return None
        if self.intermediate_size % block_size[0]:
            i, b0 = self.intermediate_size, block_size[0]
            return f"intermediate size {i} ends inside a {b0}-row block"
        if triton_fp8_gemm.default_block_k(block_size) is None:
            return f"no K step of the kernel divides {list(block_size)} blocks"
        return None

    def use_fp8_weights(self, block_size: tuple[int, int] | None) -> None:
        """Trade ``w13`` / ``w2`` for empty FP8 buffers and fp32 scales, per block of
        ``block_size`` or per row (None), on their device: ``load_expert`` then takes an FP8
        checkpoint's tensors (``ValueError`` where ``fp8_unsupported_reason`` says why not)."""
        reason = self.fp8_unsupported_reason(block_size)
        if reason is not None:
            raise ValueError(f"FP8 experts: {reason}")
        device = self.w13.device
        e, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        del self.w13, self.w2
        self.w13 = self.w2 = None
        b0, b1 = block_size or (1, None)
        for name, rows, cols in (("w13", 2 * i, h), ("w2", h, i)):
            weight = torch.empty(e, rows, cols, dtype=FP8_DTYPE, device=device)
            scale_cols = 1 if b1 is None else -(-cols // b1)
            scale = torch.empty(e, -(-rows // b0), scale_cols, device=device)
            self.register_buffer(name + "_weight", weight)
            self.register_buffer(name + "_scale", scale)
        self.fp8, self.fp8_block = True, block_size

    def dequantize_fp8_weights(self, dtype: torch.dtype) -> None:
        """Back to dense ``w13`` / ``w2`` in ``dtype``, the FP8 experts dequantized (exact)."""
        if not self.fp8:
            return
        dense = []
        for name in ("w13", "w2"):
            weight, scale = getattr(self, name + "_weight"), getattr(self, name + "_scale")
            if self.fp8_block is None:
                dense.append((weight.float() * scale).to(dtype))
            else:
                dense.append(torch.stack([
                    dequantize_fp8_blocks(w, s, self.fp8_block).to(dtype)
                    for w, s in zip(weight, scale, strict=True)
                ]))  # fmt: skip
        for name in FP8_BUFFERS:
            delattr(self, name)
        self.fp8, self.fp8_block = False, None
        self.w13 = nn.Parameter(dense[0], requires_grad=False)
        self.w2 = nn.Parameter(dense[1], requires_grad=False)

    def int4_unsupported_reason(self) -> str | None:
        """Why ``use_int4_weights`` cannot hold these experts (None: it can)."""
        if self.mxfp4 or self.fp8 or self.int4_group or self.w13_bias is not None:
            return "packed or biased experts"
        if self.hidden_size % triton_w4a16.PACK or self.intermediate_size % triton_w4a16.PACK:
            return f"hidden or intermediate size not a multiple of {triton_w4a16.PACK}"
        return None

    def use_int4_weights(self, group_size: int) -> None:
        """Trade ``w13`` / ``w2`` for empty packed 4-bit buffers (the module docstring's
        layout, groups of ``group_size`` inputs, -1: one group) on their device; they are
        filled by ``int4.fill_int4_linears``, not ``load_expert``."""
        reason = self.int4_unsupported_reason()
        if reason is not None:
            raise ValueError(f"4-bit experts: {reason}")
        device = self.w13.device
        e, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        del self.w13, self.w2
        self.w13 = self.w2 = None
        groups = []
        for name, n, k in (("w13", 2 * i, h), ("w2", h, i)):
            size = k if group_size == -1 else group_size
            g = -(-k // size)
            self.register_buffer(name + "_qweight", torch.empty(
                e, k // triton_w4a16.PACK, n, dtype=torch.int32, device=device))  # fmt: skip
            self.register_buffer(name + "_scales", torch.empty(e, g, n, device=device))
            self.register_buffer(name + "_zeros", torch.empty(e, g, n, dtype=torch.uint8,
                                                              device=device))  # fmt: skip
            groups.append(size)
        self.int4_group = (groups[0], groups[1])

    def dequantize_int4_weights(self, dtype: torch.dtype) -> None:
        """Back to dense ``w13`` / ``w2`` in ``dtype``, the 4-bit experts dequantized
        (exact: the checkpoint's values)."""
        if not self.int4_group:
            return
        from vllm.model_executor.layers.quantization.int4 import dequantize_packed

        dense = []
        for name, group in zip(("w13", "w2"), self.int4_group, strict=True):
            packed = [getattr(self, f"{name}_{t}") for t in ("qweight", "scales", "zeros")]
            experts = zip(*packed, strict=True)  # one (qweight, scales, zeros) per expert
            dense.append(torch.stack([dequantize_packed(*p, group, dtype) for p in experts]))
        for name in INT4_BUFFERS:
            delattr(self, name)
        self.int4_group = None
        self.w13 = nn.Parameter(dense[0], requires_grad=False)
        self.w2 = nn.Parameter(dense[1], requires_grad=False)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Route by the softmax of ``router_logits`` (``select_experts``), then ``apply``."""
        return self.apply(x, *select_experts(router_logits, self.top_k, self.renormalize))

    def apply(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token through the experts ``ids`` chose for it, weighted by ``weights``."""
        if self.mxfp4:
            return fused_experts_mxfp4(x, self, weights, ids)
        if self.fp8:
            return fused_experts_fp8(x, self, weights, ids)
        if self.int4_group:
            return fused_experts_int4(x, self, weights, ids)
        return fused_experts(
            x, self.w13, self.w2, weights, ids, self.activation, self.w13_bias, self.w2_bias
        )

    @torch.no_grad()
    def load_expert(
        self, expert: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
    ) -> None:
        i = self.intermediate_size
        if self.fp8:
            return self._load_fp8_expert(expert, gate, up, down)
        if self.int4_group:  # fill_int4_linears copies the packed values in
            if not all(hasattr(t, "parts") for t in (gate, up, down)):
                raise ValueError(f"expert {expert}: 4-bit experts take a checkpoint's packed "
                                 "weights (int4.PackedWeight)")  # fmt: skip
            return None
        self.w13[expert, :i].copy_(gate)
        self.w13[expert, i:].copy_(up)
        self.w2[expert].copy_(down)

    def _load_fp8_expert(self, expert: int, *parts: torch.Tensor) -> None:
        """An FP8 checkpoint's gate / up / down (``fp8_checkpoint``'s tensors: their stored
        ``fp8`` bytes and ``scale``, per row or per ``block``) into the FP8 buffers."""
        for t in parts:
            if getattr(t, "fp8", None) is None or getattr(t, "block", None) != self.fp8_block:
                raise ValueError(
                    f"expert {expert}: FP8 experts in blocks {self.fp8_block} take an FP8 "
                    "checkpoint's weights of those blocks"
                )
        gate, up, down = parts
        i = self.intermediate_size
        r = i if self.fp8_block is None else i // self.fp8_block[0]  # gate's rows of scales
        self.w13_weight[expert, :i].copy_(gate.fp8)
        self.w13_weight[expert, i:].copy_(up.fp8)
        self.w2_weight[expert].copy_(down.fp8)
        self.w13_scale[expert, :r].copy_(gate.scale.reshape(r, -1))
        self.w13_scale[expert, r:].copy_(up.scale.reshape(r, -1))
        self.w2_scale[expert].copy_(down.scale.reshape(self.w2_scale.shape[1:]))

    def _apply(self, fn, recurse: bool = True):
        # As Fp8Linear: Module.to(dtype) casts the FP8 experts and their fp32 scales too;
        # they only follow device moves (a zero-size probe tells a cast from a move).
        # 4-bit experts likewise keep their int32 / fp32 / uint8 buffers.
        if not self.fp8 and not self.int4_group:
            return super()._apply(fn, recurse)
        first = self.w13_weight if self.fp8 else self.w13_scales
        probe = fn(torch.empty(0, dtype=first.dtype, device=first.device))
        if probe.dtype == first.dtype:
            return super()._apply(fn, recurse)
        kept = {name: self._buffers.pop(name)
                for name in (FP8_BUFFERS if self.fp8 else INT4_BUFFERS)}  # fmt: skip
        super()._apply(fn, recurse)
        for name, buf in kept.items():
            self._buffers[name] = buf.to(probe.device)
        return self
