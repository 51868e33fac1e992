"""Host time of a decode step's attention metadata on the CUDA backend's path.

``TORCH_FLASH_ATTN`` with the Triton decode kernel builds, every step, the decode rows'
block table (requests x blocks of their context) and slots with numpy, then uploads them
in one copy. The runner hands each request's block ids as ``BlockIds`` (a list that keeps
an int64 numpy copy grown with it); before, as plain lists, every request's whole list was
converted every step. This times ``build_triton_decode_metadata`` for decode-only batches
from both, in the same run (the builder is numpy on the host; ``device="cpu"`` skips only
the upload, which is one copy either way). Minimum over ``--repeats`` builds.

    .venv/bin/python benchmarks/benchmark_decode_metadata.py [--batches 1 64 256]
        [--contexts 576 2048 8192]
"""

from __future__ import annotations

import argparse
import time

from vllm.v1.attention.backends.abstract import BlockIds
from vllm.v1.attention.backends.torch_flash import build_triton_decode_metadata

BLOCK_SIZE = 16


def best_ms(seqs, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        build_triton_decode_metadata(seqs, BLOCK_SIZE, "cpu", paged=False)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[576, 2048, 8192])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    print(f"{'requests':>8} {'context':>8} {'lists ms':>9} {'BlockIds ms':>12} {'ratio':>6}")
    for n in args.batches:
        for ctx in args.contexts:
            blocks = -(-(ctx + 1) // BLOCK_SIZE)
            ids = [range(1 + i * blocks, 1 + (i + 1) * blocks) for i in range(n)]
            lists = [(ctx, 1, list(r)) for r in ids]
            arrays = [(ctx, 1, BlockIds(r)) for r in ids]
            plain, grown = best_ms(lists, args.repeats), best_ms(arrays, args.repeats)
            print(f"{n:>8} {ctx:>8} {plain:>9.3f} {grown:>12.3f} {plain / grown:>5.1f}x")


if __name__ == "__main__":
    main()
