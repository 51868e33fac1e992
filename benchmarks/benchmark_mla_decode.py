"""MLA decode attention on CUDA: ``TRITON_MLA`` (the Triton latent kernel over the cache in
place) against ``TORCH_SDPA`` (what served DeepSeek on CUDA before: each decode's context
gathered, masked SDPA), one layer's decode step (cache write included), in the same run on
the same latent cache.

Prints, per shape, batch and context length, the median time of each, the ratio Triton /
SDPA (below 1: the kernel is faster) and the bandwidth the kernel reaches over the latent
bytes a step reads (batch x context x 576 values), against the HBM's (H100 3.35, H200
4.8 TB/s). ``--graph`` also times the kernel's step replayed from a CUDA graph (what a
served decode step runs), where launch overhead is gone.

    python benchmarks/benchmark_mla_decode.py [--shape v2-lite v3] [--batches 1 16 64]
        [--contexts 1024 4096] [--dtype bfloat16] [--kv-cache-dtype auto|fp8] [--graph]
        [--json-out F]

On CPU the kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1``; a test runs
``--shape tiny``): the times then say nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend
from vllm.v1.attention.backends.triton_mla import TritonMLABackend
from vllm.v1.attention.kv_cache_dtype import FP8_KV_DTYPES

# (query heads, latent, rotated key): DeepSeek-V2-Lite's 16 heads, V3's 128.
SHAPES = {"tiny": (4, 56, 8), "v2-lite": (16, 512, 64), "v3": (128, 512, 64)}
BLOCK_SIZE = 16


def step(backend, heads: int, dim: int, batch: int, context: int, num_blocks: int, g):
    """A decode step of ``batch`` sequences of ``context`` tokens in scattered blocks: its
    metadata and (q, k)."""
    need = -(-context // BLOCK_SIZE)
    ids = random.Random(batch * context).sample(range(1, num_blocks), batch * need)
    seqs = [(context - 1, 1, ids[i * need : (i + 1) * need]) for i in range(batch)]
    q = torch.randn(batch, heads, dim, generator=g).to(backend.device, backend.dtype)
    k = torch.randn(batch, 1, dim, generator=g).to(backend.device, backend.dtype)
    return backend.build_metadata(seqs), q, k


def median_ms(run, repeats: int, device: torch.device) -> float:
    with torch.inference_mode():
        run()  # compiles, warms the caches
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def graph_ms(run, repeats: int, device: torch.device) -> float:
    """``run`` captured in a CUDA graph, then its replay timed."""
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    return median_ms(graph.replay, repeats, device)


def time_backends(args: argparse.Namespace) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cache_dtype = FP8_KV_DTYPES.get(args.kv_cache_dtype, dtype)
    rows = []
    for shape in args.shape:
        heads, latent, rope = SHAPES[shape]
        dim = latent + rope
        make = dict(value_size=latent)
        triton = TritonMLABackend(heads, 1, dim, dtype, device, BLOCK_SIZE, **make)
        sdpa = TorchSDPABackend(heads, 1, dim, dtype, device, BLOCK_SIZE, **make)
        for context in args.contexts:
            for batch in args.batches:
                num_blocks = batch * -(-context // BLOCK_SIZE) + 1
                cache = torch.randn(triton.kv_cache_shape(num_blocks), device=device)
                cache = cache.to(dtype).to(cache_dtype)
                g = torch.Generator().manual_seed(0)
                row = dict(shape=shape, batch=batch, context=context)
                for name, backend in (("triton", triton), ("sdpa", sdpa)):
                    meta, q, k = step(backend, heads, dim, batch, context, num_blocks, g)

                    def run(b=backend, m=meta, q=q, k=k, cache=cache, scale=dim**-0.5):
                        return b.forward(q, k, None, cache, m, scale)

                    row[f"{name}_ms"] = median_ms(run, args.repeats, device)
                    if name == "triton" and args.graph and device.type == "cuda":
                        row["triton_graph_ms"] = graph_ms(run, args.repeats, device)
                row["ratio"] = row["triton_ms"] / row["sdpa_ms"]
                read = batch * context * dim * cache.element_size()
                row["triton_gb_s"] = read / row["triton_ms"] / 1e6
                rows.append(row)
                print(
                    f"{shape:8} batch {batch:4} context {context:6}: triton "
                    f"{row['triton_ms']:8.3f} ms ({row['triton_gb_s']:7.1f} GB/s)"
                    + (
                        f", graph {row['triton_graph_ms']:.3f} ms"
                        if "triton_graph_ms" in row
                        else ""
                    )
                    + f", sdpa {row['sdpa_ms']:8.3f} ms, triton/sdpa {row['ratio']:.2f}",
                    flush=True,
                )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["v2-lite", "v3"], choices=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *FP8_KV_DTYPES])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--graph", action="store_true", help="also time the kernel replayed")
    parser.add_argument("--json-out", type=Path)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    rows = time_backends(args)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
