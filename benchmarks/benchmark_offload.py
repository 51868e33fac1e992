"""Loading a context from the CPU KV tier vs recomputing it (prefill), on this machine.

For each context length, the median over repeats of: the prefill of the whole context in
one forward pass (what a miss costs), its load from the tier into the KV cache (what a
tier hit costs; ``consecutive``: one run of blocks on both sides, the common case;
``scattered``: every block its own copy), and its save. Per-block figures divide by the
context's blocks; the ratio is recompute / load measured in the same run.

    .venv/bin/python benchmarks/benchmark_offload.py [--contexts 512 1024 2048 4096]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm.config import CacheConfig, OffloadConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.sched.output import KVOffloadTransfers
from vllm.v1.worker.model_runner import ModelRunner


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build_runner(max_tokens: int) -> ModelRunner:
    block_size = 16
    num_blocks = max_tokens // block_size + 2
    per_block = 2 * 30 * block_size * 3 * 64 * 4  # SmolLM2-135M, fp32
    config = VllmConfig(
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
        scheduler_config=SchedulerConfig(max_model_len=8192, max_num_batched_tokens=8192),
        offload_config=OffloadConfig(kv_offloading_size=num_blocks * per_block * 1.01 / 2**30),
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    runner.initialize_kv_offload(num_blocks)
    return runner


@torch.inference_mode()
def measure(runner: ModelRunner, tokens: int, repeats: int) -> dict[str, float]:
    bs = runner.block_size
    n = tokens // bs
    gpu = list(range(1, n + 1))
    meta = runner.attn_backend.build_metadata([(0, tokens, gpu)])
    ids = torch.randint(0, 49_000, (tokens,), device=runner.device)
    pos = torch.arange(tokens, device=runner.device)
    handler = runner.kv_offload
    consecutive = KVOffloadTransfers(loads=list(zip(range(n), gpu, strict=True)))
    scattered = KVOffloadTransfers(loads=list(zip(range(n), reversed(gpu), strict=True)))
    save = KVOffloadTransfers(saves=list(zip(gpu, range(n), strict=True)))
    return {
        "blocks": n,
        "prefill": median_time(lambda: runner.model(ids, pos, meta, runner.kv_caches), repeats),
        "load": median_time(lambda: handler.transfer(consecutive), repeats),
        "load_scattered": median_time(lambda: handler.transfer(scattered), repeats),
        "save": median_time(lambda: handler.transfer(save), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runner = build_runner(max(args.contexts))
    mib = runner.get_kv_cache_bytes_per_block() / 2**20
    print(f"KV block: 16 tokens, {mib:.2f} MiB; threads: {torch.get_num_threads()}")
    header = (
        f"{'tokens':>7} {'prefill ms':>11} {'load ms':>8} {'scattered':>10} {'save ms':>8} "
        f"{'prefill/blk':>12} {'load/blk':>9} {'ratio':>7}"
    )
    print(header)
    for tokens in args.contexts:
        m = measure(runner, tokens, args.repeats)
        n = m["blocks"]
        print(
            f"{tokens:>7} {m['prefill'] * 1e3:>11.1f} {m['load'] * 1e3:>8.2f} "
            f"{m['load_scattered'] * 1e3:>10.2f} {m['save'] * 1e3:>8.2f} "
            f"{m['prefill'] / n * 1e3:>12.2f} {m['load'] / n * 1e3:>9.3f} "
            f"{m['prefill'] / m['load']:>6.0f}x"
        )


if __name__ == "__main__":
    main()
