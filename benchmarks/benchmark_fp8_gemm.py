"""FP8 weights kept in FP8 (``triton_fp8_gemm.py``) against the same weights dequantized to
the model's dtype, in the same run on the same values: the block-scaled linear layer
(``Fp8BlockLinear``, the Triton W8A16 GEMM) against ``F.linear``, and a MoE layer's FP8
experts (``FusedMoE.use_fp8_weights``, the Triton grouped GEMM) against the dense layer
(torch's grouped GEMM), on real models' shapes.

Prints, per layer and number of tokens (1-64: decode batches; 1024: a prefill chunk), the
median time of each, the ratio fp8 / dense (below 1: FP8 is faster) and the bandwidth the
FP8 path reaches over the weight bytes it reads (a linear layer's; the distinct experts
the tokens hit). Routing is random. Weights are random FP8 bytes with block scales of
128 x 128, made on the device.

    .venv/bin/python benchmarks/benchmark_fp8_gemm.py [--shape qwen3-30b-a3b]
        [--tokens 1 16 64 1024] [--device cuda] [--block-m 16] [--json-out F]

On CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``; the tests use
``--shape tiny``): the times then say nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm.model_executor.layers import triton_fp8_gemm
from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts
from vllm.model_executor.layers.quantization.fp8 import FP8_DTYPE, Fp8BlockLinear

BLOCK = (128, 128)
# Per shape: linear layers {name: (out, in)}, and the routed experts (hidden, intermediate,
# experts, top_k) or None.
SHAPES = {
    "tiny": ({"qkv": (160, 128), "o": (128, 256)}, (128, 128, 8, 2)),
    "qwen3-30b-a3b": ({"qkv": (5120, 2048), "o": (2048, 4096)}, (2048, 768, 128, 8)),
    "llama-3.1-8b": (
        {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
         "down": (4096, 14336)}, None),
}  # fmt: skip


def random_fp8(shape, device, g) -> torch.Tensor:
    b = torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8)
    return b.masked_fill_((b & 0x7F) == 0x7F, 0).view(FP8_DTYPE)  # no NaNs


def median_ms(run, repeats: int, device: torch.device) -> float:
    with torch.inference_mode():
        run()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def linear_rows(name, out, inp, tokens, args, device, dtype, g) -> list[dict]:
    weight = random_fp8((out, inp), device, g)
    scale = torch.rand(-(-out // BLOCK[0]), -(-inp // BLOCK[1]), generator=g, device=device)
    layer = Fp8BlockLinear(weight, scale * 1e-3, BLOCK)
    dense = layer.dequantized_weight(dtype)
    rows = []
    for n in tokens:
        x = torch.randn(n, inp, generator=g, device=device).to(dtype)
        kernel = partial(triton_fp8_gemm.fp8_block_linear, x, layer.weight, layer.weight_scale,
                         BLOCK, block_m=args.block_m)  # fmt: skip
        fp8 = median_ms(kernel, args.repeats, device)
        ref = median_ms(partial(F.linear, x, dense), args.repeats, device)
        nbytes = weight.numel() + scale.numel() * 4
        rows.append(dict(layer=name, tokens=n, fp8_ms=fp8, dense_ms=ref, weight_bytes=nbytes))
    return rows


def expert_rows(shape, tokens, args, device, dtype, g) -> list[dict]:
    hidden, inter, experts, top_k = shape
    with torch.device(device):
        fp8 = FusedMoE(experts, top_k, hidden, inter, True)
        fp8.use_fp8_weights(BLOCK)
    fp8 = fp8.to(dtype)
    with torch.no_grad():
        for name in ("w13", "w2"):
            weight, scale = getattr(fp8, name + "_weight"), getattr(fp8, name + "_scale")
            weight.copy_(random_fp8(weight.shape, device, g))
            scale.copy_(torch.rand(scale.shape, generator=g, device=device) * 1e-3)
    dense = copy.deepcopy(fp8)
    dense.dequantize_fp8_weights(dtype)  # the same values, dense: torch's grouped GEMM
    expert_bytes = 3 * hidden * inter + (fp8.w13_scale[0].numel() + fp8.w2_scale[0].numel()) * 4
    rows = []
    for n in tokens:
        x = torch.randn(n, hidden, generator=g, device=device).to(dtype)
        logits = torch.randn(n, experts, generator=g, device=device)
        hit = select_experts(logits, top_k, True)[1].unique().numel()
        fp8_ms = median_ms(partial(fp8, x, logits), args.repeats, device)
        dense_ms = median_ms(partial(dense, x, logits), args.repeats, device)
        rows.append(dict(layer="experts", tokens=n, fp8_ms=fp8_ms, dense_ms=dense_ms,
                         weight_bytes=hit * expert_bytes, experts_hit=hit))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 1024])
    ap.add_argument("--block-m", type=int, default=None, help="the linear kernel's row tile")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    linears, experts = SHAPES[args.shape]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreted)"
    print(f"machine: {name}; {args.shape}, {args.dtype}, FP8 in {list(BLOCK)} blocks")
    rows = []
    for layer, (out, inp) in linears.items():
        rows += linear_rows(layer, out, inp, args.tokens, args, device, dtype, g)
    if experts is not None:
        rows += expert_rows(experts, args.tokens, args, device, dtype, g)
    print(f"{'layer':>8} {'tokens':>6} {'fp8 ms':>9} {'dense ms':>9} {'fp8/dense':>9} {'GB/s':>7}")
    for row in rows:
        row["ratio"] = row["fp8_ms"] / row["dense_ms"]
        row["fp8_gb_s"] = row["weight_bytes"] / (row["fp8_ms"] / 1e3) / 1e9
        print(f"{row['layer']:>8} {row['tokens']:>6} {row['fp8_ms']:9.3f} "
              f"{row['dense_ms']:9.3f} {row['ratio']:9.2f} {row['fp8_gb_s']:7.1f}")  # fmt: skip
    if args.json_out:
        report = dict(machine=name, shape=args.shape, dtype=args.dtype, rows=rows)
        args.json_out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
