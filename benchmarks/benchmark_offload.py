"""Loading a context from the host-memory KV tier vs recomputing it (prefill), on this machine.

For each context length, the median over repeats of: the prefill of the whole context as
the engine would run it (chunks of ``--chunk-tokens``, each attending to the chunks before
it: what a miss costs), its load from the tier into the KV cache (what a tier hit costs;
``load``: one run of blocks on both sides; ``scattered``: the device blocks in reverse
order, as a pool that has churned hands them out, by the handler's own path (staged on
CUDA: a few host copies and one indexed copy per layer and K/V, the two on their own
streams so that they overlap; ``1 stream``: the same staging with both on the tier's
stream, as before they overlapped); ``unstaged``: the same with one copy per block, layer
and K/V, the baseline), and its save (``scat.save``: from reversed device blocks).
Per-block figures divide by the context's blocks; the ratios are recompute / load
(consecutive and scattered) measured in the same run, and the load's bandwidth is the
context's KV bytes over its time.

The model: the embedded default (fp32 on CPU, ``--shape default``), or a random-weight
model of a named shape (benchmarks/benchmark_gpu.py's: tiny, smollm2-135m, llama-3.2-1b,
llama-3.1-8b) made by the engine on the device (``--load-format dummy``: nothing is
written or read). On CUDA the tier is pinned host memory and the copies run on the tier's
side stream; every timing synchronizes the device before it starts and before it ends.

    .venv/bin/python benchmarks/benchmark_offload.py [--contexts 512 1024 2048 4096]
        [--repeats 3]
    python benchmarks/benchmark_offload.py --shape llama-3.1-8b --contexts 2048 8192 32768 \\
        --json-out /tmp/offload.json     # a GPU (issue 28)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmark_gpu, when imported
import benchmark_gpu  # noqa: E402

from vllm.config import (  # noqa: E402
    DEFAULT_MODEL,
    CacheConfig,
    ModelConfig,
    OffloadConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.core.sched.output import KVOffloadTransfers  # noqa: E402
from vllm.v1.worker.model_runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16
SHAPES = ("default", *benchmark_gpu.SHAPES)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model_config(shape: str, dtype: str, max_tokens: int) -> ModelConfig:
    """The embedded model (``default``), or a config-only folder of a named shape served
    with dummy weights, its positions raised to ``max_tokens``."""
    if shape == "default":
        return ModelConfig(model=DEFAULT_MODEL, dtype=dtype)
    folder = Path(f"/tmp/vllm-offload-models/{shape}-{max_tokens}")
    benchmark_gpu.write_config_dir(shape, folder, benchmark_gpu.default_tokenizer_dir())
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_tokens)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return ModelConfig(model=str(folder), dtype=dtype, load_format="dummy")


def build_runner(shape: str, dtype: str, max_tokens: int, chunk: int) -> ModelRunner:
    """A runner with a KV cache and a tier each holding ``max_tokens`` (+ the null block)."""
    num_blocks = max_tokens // BLOCK_SIZE + 2
    config = VllmConfig(
        model_config=model_config(shape, dtype, max_tokens),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks),
        scheduler_config=SchedulerConfig(
            max_model_len=max_tokens, max_num_batched_tokens=chunk, max_num_seqs=1
        ),
        offload_config=OffloadConfig(kv_offloading_size=0),  # sized below, in blocks
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    runner.initialize_kv_offload(num_blocks)
    return runner


@torch.inference_mode()
def measure(runner: ModelRunner, tokens: int, chunk: int, repeats: int) -> dict[str, float]:
    bs, device = runner.block_size, runner.device
    n = tokens // bs
    gpu = list(range(1, n + 1))
    vocab = runner.arch.vocab_size
    ids = torch.randint(0, vocab, (tokens,), device=device)
    pos = torch.arange(tokens, device=device)
    steps = []  # (ids, positions, metadata) of each chunk, built once
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        meta = runner.attn_backend.build_metadata([(start, end - start, gpu)])
        steps.append((ids[start:end], pos[start:end], meta))

    def prefill() -> None:
        for chunk_ids, chunk_pos, meta in steps:
            runner.model(chunk_ids, chunk_pos, meta, runner.kv_caches)

    handler = runner.kv_offload
    consecutive = KVOffloadTransfers(loads=list(zip(range(n), gpu, strict=True)))
    scattered = KVOffloadTransfers(loads=list(zip(range(n), reversed(gpu), strict=True)))
    save = KVOffloadTransfers(saves=list(zip(gpu, range(n), strict=True)))
    scattered_save = KVOffloadTransfers(saves=list(zip(reversed(gpu), range(n), strict=True)))
    load = median_time(lambda: handler.transfer(consecutive), repeats, device)
    m = {
        "tokens": tokens,
        "blocks": n,
        "chunks": len(steps),
        "prefill_s": median_time(prefill, repeats, device),
        "load_s": load,
        # the handler's own path: staged on CUDA (kv_offload/worker.py), per block on CPU
        "load_scattered_s": median_time(lambda: handler.transfer(scattered), repeats, device),
        "save_s": median_time(lambda: handler.transfer(save), repeats, device),
        "save_scattered_s": median_time(lambda: handler.transfer(scattered_save), repeats, device),
        "load_gb_per_s": n * handler.block_bytes / load / 1e9,
    }
    if handler.index_stream is not None:  # CUDA: the staged copy's two stages on one stream
        index_stream, handler.index_stream = handler.index_stream, handler.stream
        try:
            for kind, plan in (("load", scattered), ("save", scattered_save)):
                m[f"{kind}_scattered_one_stream_s"] = median_time(
                    lambda plan=plan: handler.transfer(plan), repeats, device
                )
        finally:
            handler.index_stream = index_stream
    staged = handler.staged
    handler.staged = False  # the baseline: one copy per block, layer and K/V
    try:
        m["load_scattered_unstaged_s"] = median_time(
            lambda: handler.transfer(scattered), repeats, device
        )
    finally:
        handler.staged = staged
    return m


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=SHAPES, default="default")
    ap.add_argument("--dtype", choices=["auto", *benchmark_gpu.DTYPES], default="auto",
                    help="auto: float32 on CPU, bfloat16 on CUDA")  # fmt: skip
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument(
        "--chunk-tokens", type=int, default=None,
        help="prefill chunk (the step budget); default 8192 on CUDA, 2048 on CPU",
    )  # fmt: skip
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    for tokens in args.contexts:
        if tokens < BLOCK_SIZE or tokens % BLOCK_SIZE:
            ap.error(f"--contexts: {tokens} is not a positive multiple of {BLOCK_SIZE}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == "auto":
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    chunk = args.chunk_tokens or (8192 if device.type == "cuda" else 2048)
    runner = build_runner(args.shape, args.dtype, max(args.contexts), chunk)
    info = benchmark_gpu.machine_info(device)
    block_bytes = runner.kv_offload.block_bytes
    pinner = runner.kv_offload.pinner  # CUDA: the tier is page-locked in the background
    if pinner is not None:
        pinner.done.wait()  # the figures are those of pinned memory
        if pinner.error is not None:
            print(f"the tier could not be page-locked: {pinner.error}", flush=True)
    results = {
        "machine": info,
        "shape": args.shape,
        "dtype": args.dtype,
        "chunk_tokens": chunk,
        "repeats": args.repeats,
        "kv_block_bytes": block_bytes,
        "pinned": pinner is not None and pinner.error is None,
        "pin_s": pinner.seconds if pinner is not None else None,
        "rows": [],
    }
    print(f"machine: {info['device_name']} ({device.type}), torch {info['torch']}; "
          f"{args.shape} {args.dtype}; KV block: {BLOCK_SIZE} tokens, "
          f"{block_bytes / 2**20:.2f} MiB; prefill chunks of {chunk} tokens"
          + (f"; threads: {torch.get_num_threads()}" if device.type == "cpu" else "")
          + (f"; tier page-locked in {pinner.seconds:.1f} s" if results["pin_s"] else ""),
          flush=True)  # fmt: skip
    header = (
        f"{'tokens':>7} {'prefill ms':>11} {'load ms':>8} {'scattered':>10} {'1 stream':>9} "
        f"{'unstaged':>9} {'save ms':>8} {'scat.save':>9} {'1 stream':>9} {'load/blk':>9} "
        f"{'load GB/s':>9} {'ratio':>7} {'scat.ratio':>10}"
    )
    print(header, flush=True)
    for tokens in args.contexts:
        m = measure(runner, tokens, chunk, args.repeats)
        m["ratio"] = m["prefill_s"] / m["load_s"]
        m["scattered_ratio"] = m["prefill_s"] / m["load_scattered_s"]
        results["rows"].append(m)
        n = m["blocks"]
        one = {k: f"{m[f'{k}_scattered_one_stream_s'] * 1e3:.2f}" for k in ("load", "save")
               if f"{k}_scattered_one_stream_s" in m}  # fmt: skip
        print(
            f"{tokens:>7} {m['prefill_s'] * 1e3:>11.1f} {m['load_s'] * 1e3:>8.2f} "
            f"{m['load_scattered_s'] * 1e3:>10.2f} {one.get('load', '-'):>9} "
            f"{m['load_scattered_unstaged_s'] * 1e3:>9.2f} "
            f"{m['save_s'] * 1e3:>8.2f} {m['save_scattered_s'] * 1e3:>9.2f} "
            f"{one.get('save', '-'):>9} "
            f"{m['load_s'] / n * 1e3:>9.3f} {m['load_gb_per_s']:>9.1f} {m['ratio']:>6.0f}x "
            f"{m['scattered_ratio']:>9.1f}x",
            flush=True,
        )
        if args.json_out:  # after every row: a run stopped by a time limit keeps them
            args.json_out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
