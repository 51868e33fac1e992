"""MLA prefill attention on CUDA: ``TRITON_MLA``'s prefill kernel (the chunk's rows over the
latent cache in place) against ``TORCH_SDPA``'s path it replaces (the chunk's context
gathered, SDPA at head size 576, which no FlashAttention kernel takes: the scores are
materialised), one layer's prefill chunk (cache write included), in the same run on the
same latent cache.

Prints, per shape, chunk and cached prefix, the median time of each (``oom`` where SDPA
runs out of memory), the ratio Triton / SDPA (below 1: the kernel is faster), the peak
memory each allocates beyond the inputs, and the kernel's TFLOP/s over the absorbed
products it computes (heads x the keys each row sees x (576 + 512) x 2), against the
card's bf16 dense peak (H100/H200 ~990). An agent's 30k-token context prefilled in
8k-token chunks is ``--chunks 8192 --prefixes 0 8192 16384 22528``.

    python benchmarks/benchmark_mla_prefill.py [--shape v2-lite v3] [--chunks 2048 8192]
        [--prefixes 0 4096 22528] [--dtype bfloat16] [--kv-cache-dtype auto|fp8]
        [--json-out F]

On CPU the kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1``; a test runs
``--shape tiny``): the times then say nothing.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_mla_decode import BLOCK_SIZE, SHAPES, median_ms  # noqa: E402

from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend  # noqa: E402
from vllm.v1.attention.backends.triton_mla import TritonMLABackend  # noqa: E402
from vllm.v1.attention.kv_cache_dtype import FP8_KV_DTYPES  # noqa: E402


def chunk_step(backend, heads: int, dim: int, chunk: int, prefix: int, num_blocks: int, g):
    """One sequence's chunk of ``chunk`` tokens over ``prefix`` cached ones in scattered
    blocks: its metadata and (q, k)."""
    need = -(-(prefix + chunk) // BLOCK_SIZE)
    ids = random.Random(chunk * 7 + prefix).sample(range(1, num_blocks), need)
    q = torch.randn(chunk, heads, dim, generator=g).to(backend.device, backend.dtype)
    k = torch.randn(chunk, 1, dim, generator=g).to(backend.device, backend.dtype)
    return backend.build_metadata([(prefix, chunk, ids)]), q, k


def absorbed_flops(heads: int, latent: int, rope: int, chunk: int, prefix: int) -> float:
    """The products' FLOPs: row j of the chunk sees prefix + j + 1 keys, each a 576-wide
    score and a 512-wide value per head."""
    keys = chunk * prefix + chunk * (chunk + 1) // 2
    return 2.0 * heads * keys * (2 * latent + rope)


def peak_mb(run, device: torch.device) -> float:
    """Memory ``run`` allocates beyond what is held before it (CUDA only, else 0)."""
    if device.type != "cuda":
        run()
        return 0.0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        run()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def time_one(run, repeats: int, device: torch.device) -> tuple[float | None, float | None]:
    """(median ms, peak MB), or (None, None) where the run is out of memory."""
    try:
        mb = peak_mb(run, device)
        return median_ms(run, repeats, device), mb
    except torch.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return None, None


def time_backends(args: argparse.Namespace) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cache_dtype = FP8_KV_DTYPES.get(args.kv_cache_dtype, dtype)
    rows = []
    for shape in args.shape:
        heads, latent, rope = SHAPES[shape]
        dim = latent + rope
        make = dict(value_size=latent)
        triton = TritonMLABackend(heads, 1, dim, dtype, device, BLOCK_SIZE, **make)
        if not triton.prefill_kernel:
            raise SystemExit(f"the Triton MLA prefill kernel cannot run on {device}")
        sdpa = TorchSDPABackend(heads, 1, dim, dtype, device, BLOCK_SIZE, **make)
        for prefix in args.prefixes:
            for chunk in args.chunks:
                num_blocks = -(-(prefix + chunk) // BLOCK_SIZE) + 1
                cache = torch.randn(triton.kv_cache_shape(num_blocks), device=device)
                cache = cache.to(dtype).to(cache_dtype)
                row = dict(shape=shape, chunk=chunk, prefix=prefix)
                for name, backend in (("triton", triton), ("sdpa", sdpa)):
                    g = torch.Generator().manual_seed(0)
                    meta, q, k = chunk_step(backend, heads, dim, chunk, prefix, num_blocks, g)

                    def run(b=backend, m=meta, q=q, k=k, cache=cache, scale=dim**-0.5):
                        return b.forward(q, k, None, cache, m, scale)

                    row[f"{name}_ms"], row[f"{name}_peak_mb"] = time_one(run, args.repeats, device)
                    del meta, q, k, run
                row["ratio"] = row["sdpa_ms"] and row["triton_ms"] / row["sdpa_ms"]
                flops = absorbed_flops(heads, latent, rope, chunk, prefix)
                row["triton_tflop_s"] = flops / row["triton_ms"] / 1e9
                rows.append(row)
                sdpa_text = (
                    "sdpa      oom"
                    if row["sdpa_ms"] is None
                    else f"sdpa {row['sdpa_ms']:9.3f} ms ({row['sdpa_peak_mb']:8.1f} MB), "
                    f"triton/sdpa {row['ratio']:.3f}"
                )
                print(
                    f"{shape:8} chunk {chunk:6} prefix {prefix:6}: triton "
                    f"{row['triton_ms']:9.3f} ms ({row['triton_tflop_s']:6.1f} TFLOP/s, "
                    f"{row['triton_peak_mb']:8.1f} MB), {sdpa_text}",
                    flush=True,
                )
                del cache
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["v2-lite", "v3"], choices=list(SHAPES))
    parser.add_argument("--chunks", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--prefixes", nargs="+", type=int, default=[0, 4096, 22528])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *FP8_KV_DTYPES])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out", type=Path)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    rows = time_backends(args)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
