"""One mixture-of-experts layer's experts (``layers/fused_moe.py``) on a real model's shape:
the grouped-GEMM path the engine runs, against the loop over experts hit (its eager
fallback) and the dense path (every expert on every token; what CUDA-graph capture falls
back to without grouped GEMM), in the same run on the same weights and routing.

Prints, per number of tokens (1-64: decode batches; 512: a prefill chunk), the median
time of each path, the grouped path's ratio to the loop, and the bandwidth the grouped
path reaches over the expert weights a step must read (the distinct experts its tokens
hit). Routing is random (uniform over experts), so more experts are hit than a trained
router would pick. Weights random, made on the device in the target dtype.

    .venv/bin/python benchmarks/benchmark_moe.py [--shape qwen3-30b-a3b] [--dtype float32]
        [--tokens 1 8 64 512] [--device cpu|cuda] [--paths grouped loop dense]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpu import DTYPES, cpu_model, sync, vector_extensions  # noqa: E402

from vllm.model_executor.layers import fused_moe  # noqa: E402

# (hidden, expert intermediate, experts, top_k, renormalize) of one layer's routed experts.
SHAPES = {
    "tiny": (64, 48, 8, 2, True),
    "qwen3-30b-a3b": (2048, 768, 128, 8, True),  # also Qwen3-Coder-30B-A3B
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4, False),
    "mixtral-8x7b": (4096, 14336, 8, 2, True),
}


def make_layer(shape: str, dtype: torch.dtype, device: torch.device) -> fused_moe.FusedMoE:
    hidden, inter, experts, top_k, renormalize = SHAPES[shape]
    with torch.device(device):
        layer = fused_moe.FusedMoE(experts, top_k, hidden, inter, renormalize).to(dtype)
        for p in layer.parameters():
            p.data.uniform_(-0.05, 0.05)
    return layer


def time_path(path: str, layer, x, logits, repeats: int) -> float:
    """Median milliseconds of ``path`` over ``repeats`` calls, after one warm-up call."""
    weights, ids = fused_moe.select_experts(logits, layer.top_k, layer.renormalize)
    if path == "dense":
        run = lambda: fused_moe._dense_experts(x, layer.w13, layer.w2, weights, ids)  # noqa: E731
    else:
        run = lambda: fused_moe.fused_experts(x, layer.w13, layer.w2, weights, ids)  # noqa: E731
    original = fused_moe.grouped_mm_supported
    if path == "loop":
        fused_moe.grouped_mm_supported = lambda a, w: False
    try:
        with torch.inference_mode():
            run()
            times = []
            for _ in range(repeats):
                sync(x.device)
                start = time.perf_counter()
                run()
                sync(x.device)
                times.append(time.perf_counter() - start)
    finally:
        fused_moe.grouped_mm_supported = original
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: fp32 on "
                    "the CPU (the engine's CPU dtype), bf16 on CUDA")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--paths", nargs="+", choices=["grouped", "loop", "dense"],
                    default=["grouped", "loop", "dense"])  # fmt: skip
    ap.add_argument("--dense-max-tokens", type=int, default=64,
                    help="skip the dense path above this many tokens (it is slow)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    layer = make_layer(args.shape, dtype, device)
    hidden, inter, experts, top_k, _ = SHAPES[args.shape]
    expert_bytes = 3 * hidden * inter * layer.w13.element_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"{cpu_model()} ({vector_extensions()}), {torch.get_num_threads()} threads"
    )  # fmt: skip
    print(f"machine: {name}")
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"{args.shape}: {experts} experts of {hidden}x{inter}, top {top_k}, {dtype_name}, "
          f"{expert_bytes / 1e6:.1f} MB an expert")  # fmt: skip
    print(f"{'tokens':>6} {'hit':>4} " + " ".join(f"{p + ' ms':>11}" for p in args.paths)
          + f" {'loop/grouped':>12} {'GB/s':>7}")  # fmt: skip
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for n in args.tokens:
        x = torch.randn(n, hidden, generator=g, device=device).to(dtype)
        logits = torch.randn(n, experts, generator=g, device=device)
        hit = fused_moe.select_experts(logits, top_k, True)[1].unique().numel()
        row = {"tokens": n, "experts_hit": hit}
        for path in args.paths:
            if path == "dense" and n > args.dense_max_tokens:
                continue
            row[f"{path}_ms"] = time_path(path, layer, x, logits, args.repeats)
        grouped, loop = row.get("grouped_ms"), row.get("loop_ms")
        if grouped:
            row["grouped_gb_s"] = hit * expert_bytes / (grouped / 1e3) / 1e9
        ratio = f"{loop / grouped:12.2f}" if grouped and loop else f"{'-':>12}"
        cells = " ".join(f"{row[f'{p}_ms']:11.3f}" if f"{p}_ms" in row else f"{'-':>11}"
                         for p in args.paths)  # fmt: skip
        gbs = f"{row['grouped_gb_s']:7.1f}" if grouped else f"{'-':>7}"
        print(f"{n:6d} {hit:4d} {cells} {ratio} {gbs}")
        rows.append(row)
    if args.json_out:
        report = {"machine": name, "shape": args.shape, "dtype": str(dtype), "rows": rows}
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
