"""The GGUF block kernel (``ggml_linear``) alone, one layer at a time, kernel against kernel.

For SmolLM2-135M's layer shapes (Q4_1 weights; the tied lm_head in Q8_0) and decode batch
sizes, the time of one call of each variant of the native kernel, measured in the same run,
interleaved (medians of ``--repeats`` rounds), and the ratio against the first variant:

    avx2  the AVX2 tile (the kernel before AVX-512; 1-4 tokens: the fused AVX2 kernel for all)
    fp32  fp32 activations, AVX-512 from 5 tokens on (the default)
    int8  int8 activations per 32-value block, AVX512-VNNI from 5 tokens on
    bf16  bf16 products on AMX tiles from 5 tokens on (fp32 on CPUs without AMX-BF16)

(1-4 tokens: every variant but avx2 runs the AVX-512 fused kernel.) The last line adds a
whole decode step's layers (30 x qkv + o + gate_up + down, + lm_head). ``--from-memory``:
each layer gets as many copies as a step has (30; the lm_head is 30 MB alone) and the calls
go through them in turn, so the blocks come from memory as in a real step, not from cache.

    .venv/bin/python benchmarks/benchmark_gguf_kernel.py [--tokens 1 4 8 16 32] [--repeats 5]
    .venv/bin/python benchmarks/benchmark_gguf_kernel.py --from-memory --variants fp32 bf16
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from tests.kernels.test_quant_kernels import random_blocks
from vllm import _custom_ops as ops

# name -> ggml_linear's ``variant`` argument
VARIANTS = {"avx2": 2, "fp32": 0, "int8": 1, "bf16": 3}
# name -> (out features, in features, GGML type, times per decode step)
LAYERS = {
    "576->1536": (1536, 576, ops.GGML_Q4_1, 0),
    "qkv 576->960": (960, 576, ops.GGML_Q4_1, 30),
    "o 576->576": (576, 576, ops.GGML_Q4_1, 30),
    "gate_up 576->3072": (3072, 576, ops.GGML_Q4_1, 30),
    "down 1536->576": (576, 1536, ops.GGML_Q4_1, 30),
    "lm_head 576->49152": (49152, 576, ops.GGML_Q8_0, 1),
}


def time_ms(fn, min_s: float = 0.05) -> float:
    """Mean ms of a call over at least ``min_s`` seconds (after a warm-up call)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min_s or n < 3:
        fn()
        n += 1
    return elapsed / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--from-memory", action="store_true", help="a step's copies of each layer")
    args = ap.parse_args()
    if not ops.ensure_quant_kernels():
        raise SystemExit("the native kernels are not available")
    linear = torch.ops.vllm_continuum_C.ggml_linear.default
    weights = {
        name: itertools.cycle(
            [random_blocks(n, k, qtype, seed=i) for i in range(per_step if args.from_memory else 1)]
        )
        for name, (n, k, qtype, per_step) in LAYERS.items()
        if per_step or not args.from_memory
    }
    xs = {m: torch.randn(m, 1536) for m in args.tokens}

    def call(layer: str, m: int, variant: str):
        _, k, qtype, _ = LAYERS[layer]
        x, ws, v = xs[m][:, :k].contiguous(), weights[layer], VARIANTS[variant]
        return lambda: linear(x, next(ws), qtype, v)

    runs: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.repeats):
        for layer in weights:
            for m in args.tokens:
                for v in args.variants:  # interleaved: every variant sees the same load
                    runs.setdefault((layer, m, v), []).append(time_ms(call(layer, m, v)))
    med = {key: statistics.median(ts) for key, ts in runs.items()}

    base, others = args.variants[0], args.variants[1:]
    print(
        f"threads {torch.get_num_threads()}; ms per call (median of {args.repeats}); "
        f"ratios: {base} time / variant time"
    )
    print(
        f"{'layer':20}{'M':>4}"
        + "".join(f"{v:>9}" for v in args.variants)
        + "".join(f"{v + ' x':>9}" for v in others)
    )
    for layer in [*weights, "decode step"]:
        for m in args.tokens:
            if layer == "decode step":
                t = {
                    v: sum(med[(name, m, v)] * LAYERS[name][3] for name in weights)
                    for v in args.variants
                }
            else:
                t = {v: med[(layer, m, v)] for v in args.variants}
            print(
                f"{layer:20}{m:4d}"
                + "".join(f"{t[v]:9.3f}" for v in args.variants)
                + "".join(f"{t[base] / t[v]:8.2f}x" for v in others)
            )


if __name__ == "__main__":
    main()
