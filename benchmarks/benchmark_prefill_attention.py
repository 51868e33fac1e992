"""Prefill attention of one layer: torch SDPA vs the native kernel (fp32, and bf16 where the
CPU has AVX512_BF16), ms per layer and the ratio, measured in the same run.

Inputs are as in the engine: q, k, v strided views of one fused qkv output, causal, GQA
(default: SmolLM2-135M's 9 query heads over 3 KV heads, head_dim 64). Each timing is the
best of ``--repeats`` rounds of ``--iters`` calls; the three run one after another per length.
The native kernels must be built (``make kernels``).

    .venv/bin/python benchmarks/benchmark_prefill_attention.py [--lengths 256 1024 2048]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.nn.functional as F

from vllm import _custom_ops as ops
from vllm.v1.attention.backends.torch_sdpa import native_prefill_attention


def best_ms(fn, iters: int, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


def length_row(n: int, h: int, kvh: int, dim: int, repeats: int) -> str:
    """One length: SDPA, native fp32, native bf16 (ms, ratio) and their max abs diffs."""
    scale = dim**-0.5
    qkv = torch.randn(n, (h + 2 * kvh) * dim)
    q, k, v = qkv.split([h * dim, kvh * dim, kvh * dim], dim=-1)
    q, k, v = q.view(n, h, dim), k.view(n, kvh, dim), v.view(n, kvh, dim)
    out = torch.empty(n, h, dim)

    def sdpa():
        o = F.scaled_dot_product_attention(  # as paged_attention calls it: (1, heads, n, dim)
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=True,
        )  # fmt: skip
        out.copy_(o[0].transpose(0, 1))  # the engine's (tokens, heads, dim) layout

    iters = max(2, 4096 // n)
    t_sdpa = best_ms(sdpa, iters, repeats)
    ref = out.clone()
    row, errs = f"{n:>7} {t_sdpa:>8.2f}", ""
    for bf16 in (False, True):
        native = functools.partial(native_prefill_attention, out, q, k, v, scale, bf16)
        if not native():
            row += f" {'-':>8} {'-':>6}"
            continue
        errs += f"  {'bf16' if bf16 else 'fp32'} {(out - ref).abs().max().item():.1e}"
        t = best_ms(native, iters, repeats)
        row += f" {t:>8.2f} {t_sdpa / t:>5.2f}x"
    return row + errs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ops.ensure_native_kernels()
    print(f"heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, {args.threads} threads")
    cols = ("tokens", "sdpa ms", "fp32 ms", "x", "bf16 ms", "x")
    head = zip(cols, (7, 8, 8, 6, 8, 6), strict=True)
    print(" ".join(f"{c:>{w}}" for c, w in head) + "  max abs diff")
    for n in args.lengths:
        print(length_row(n, args.heads, args.kv_heads, args.head_dim, args.repeats), flush=True)


if __name__ == "__main__":
    main()
