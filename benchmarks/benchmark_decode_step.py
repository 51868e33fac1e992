"""Batch-1 decode step of the model alone (no scheduler, no sampler), and where it goes.

For each weight format and context length: prefill a context of random tokens, then time
``--steps`` decode steps (metadata build, forward, lm_head, argmax), median over the steps;
formats interleaved per context. ``--profile FORMAT`` adds a torch.profiler table of that
format's steps at the first context length: self CPU time by op, and the step split into
linear layers, attention, other ops, and the rest (wall time outside any op: Python).

    .venv/bin/python benchmarks/benchmark_decode_step.py [--contexts 64 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# Parts of a step, by op name without its namespace (anything else: "other ops").
CATEGORIES = {
    "linear": ("ggml_linear", "ggml_dequantize", "mm", "addmm", "linear", "matmul"),
    "attention": (
        "paged_decode_attention",
        "reshape_and_cache",
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "index",
    ),
}


def prefill(runner, ids: list[int], chunk: int = 256) -> None:
    from vllm.benchmarks.model_runner import forward

    for start in range(0, len(ids), chunk):
        forward(runner, ids[start : start + chunk], start)


def decode_step(runner, token: int, position: int) -> int:
    from vllm.benchmarks.model_runner import forward

    logits = runner.model.compute_logits(forward(runner, [token], position))
    return int(logits.argmax(-1))


def step_times(runner, context: int, steps: int, seed: int = 0) -> list[float]:
    """Seconds per decode step after a ``context``-token prefill."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, runner.arch.vocab_size, (context,), generator=g).tolist()
    prefill(runner, ids)
    token, times = ids[-1], []
    for i in range(steps):
        t0 = time.perf_counter()
        token = decode_step(runner, token, context + i)
        times.append(time.perf_counter() - t0)
    return times


def profile(runner, context: int, steps: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step_times(runner, context, 2)  # warm-up
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(100, runner.arch.vocab_size, (context,), generator=g).tolist()
    prefill(runner, ids)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        token = ids[-1]
        for i in range(steps):
            token = decode_step(runner, token, context + i)
        wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=18))
    parts = {name: 0.0 for name in CATEGORIES} | {"other ops": 0.0}
    calls = 0
    for e in events:
        calls += e.count
        op = e.key.rsplit("::", 1)[-1]
        part = next((p for p, names in CATEGORIES.items() if op in names), None)
        parts[part or "other ops"] += e.self_cpu_time_total
    parts["outside ops (Python)"] = max(wall_us - sum(parts.values()), 0.0)
    print(f"per step (profiled, so inflated): {wall_us / steps / 1e3:.2f} ms, {calls // steps} ops")
    for name, us in parts.items():
        print(f"  {name:22}{us / steps / 1e3:8.2f} ms  {us / wall_us:6.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", nargs="+", default=["fp32", "gguf"], choices=["fp32", "gguf"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[64, 1024, 2048, 4096])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--profile", choices=["fp32", "gguf"], help="profile this format's steps")
    args = ap.parse_args()

    from vllm.benchmarks.model_runner import load_runner, quantize

    max_tokens = max(args.contexts) + args.steps
    runners = {}
    for fmt in args.formats:
        runners[fmt] = load_runner(max_tokens)
        if fmt == "gguf":
            quantize(runners[fmt])
    print(f"threads: {torch.get_num_threads()}; median of {args.steps} decode steps (ms)")
    print(f"{'context':>8}" + "".join(f"{fmt:>10}" for fmt in runners))
    for context in args.contexts:
        row = {}
        for fmt, runner in runners.items():  # interleaved: both see the same machine load
            step_times(runner, context, 2)  # warm-up at this length
            row[fmt] = statistics.median(step_times(runner, context, args.steps)) * 1e3
        print(f"{context:>8}" + "".join(f"{row[fmt]:10.2f}" for fmt in runners))
    if args.profile:
        if args.profile not in runners:
            runners[args.profile] = load_runner(max_tokens)
            if args.profile == "gguf":
                quantize(runners[args.profile])
        print(f"\nprofile: {args.profile}, context {args.contexts[0]}")
        profile(runners[args.profile], args.contexts[0], args.steps)


if __name__ == "__main__":
    main()
