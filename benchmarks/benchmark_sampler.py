"""Sampling a batch together against row by row, for rows with penalties and filters.

Until session 21 the sampler batched only greedy rows and rows with a temperature alone;
a row with a penalty (repetition, presence, frequency) or a filter (top-k, top-p, min-p)
was sampled by itself: ~10 small ops and two or three reads to the host each, which on a
GPU are a sync each (256 such rows: ~700 syncs a step). Now every row is sampled in one
pass (``sample_on_device``) and read back once. This times ``sample`` on a batch of N such
rows against ``sample`` called on each row alone (the old cost's shape), in the same run,
on the same logits, and checks they give the same tokens (seeded rows).

    .venv/bin/python benchmarks/benchmark_sampler.py [--num-requests 1 16 64 256]
        [--vocab 128256] [--prompt-len 512] [--output-len 128] [--device cpu|cuda]
        [--mix penalties|filters|both] [--repeats 5] [--json-out FILE]

Medians of ``--repeats`` timed calls after one warm-up. The figures are this machine's:
name its CPU (or GPU) with them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.sampler import PrefixView, SamplingRow, sample

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_gpu  # noqa: E402  (the machine's description)

MIXES = {
    "penalties": dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.3),
    "filters": dict(temperature=0.8, top_p=0.9, top_k=50),
    "both": dict(temperature=0.8, top_p=0.9, presence_penalty=0.5, repetition_penalty=1.05),
}


def make_rows(n: int, args: argparse.Namespace, device: torch.device) -> list[SamplingRow]:
    rng = random.Random(0)
    rows = []
    for i in range(n):
        params = SamplingParams(seed=i, max_tokens=args.output_len, **MIXES[args.mix])
        output = [rng.randrange(args.vocab) for _ in range(args.output_len)]
        tokens = [rng.randrange(args.vocab) for _ in range(args.prompt_len)] + output
        gen = torch.Generator(device=device).manual_seed(i)
        # As the runner builds them: the prompt a view into the request's token list.
        rows.append(SamplingRow(params, gen, PrefixView(tokens, args.prompt_len), output))
    return rows


def reseed(rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        r.generator.manual_seed(i)


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(n: int, args: argparse.Namespace, device: torch.device) -> dict:
    logits = torch.randn(n, args.vocab, generator=torch.Generator().manual_seed(n)).to(device)
    rows = make_rows(n, args, device)

    def together():
        reseed(rows)
        return sample(logits, rows).token_ids

    def alone():
        reseed(rows)
        return [sample(logits[i : i + 1], [r]).token_ids[0] for i, r in enumerate(rows)]

    same = together() == alone()  # also the warm-up of both
    t_batch, t_rows = [], []
    for _ in range(args.repeats):  # interleaved: drift hits both alike
        t_batch.append(timed(together, device))
        t_rows.append(timed(alone, device))
    # The ratio of the figures as printed, so that the record agrees with itself.
    batch_ms = round(statistics.median(t_batch) * 1e3, 3)
    rows_ms = round(statistics.median(t_rows) * 1e3, 3)
    return dict(
        num_requests=n,
        together_ms=batch_ms,
        row_by_row_ms=rows_ms,
        speedup=round(rows_ms / batch_ms, 2),
        same_tokens=same,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=128256, help="Llama-3's by default")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--mix", choices=sorted(MIXES), default="both")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json-out", help="write the results here too")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    device = torch.device(args.device)
    machine = benchmark_gpu.machine_info(device)
    if device.type == "cpu":
        machine["vector_extensions"] = benchmark_gpu.vector_extensions()
    print(f"# {machine['device_name']} ({machine.get('vector_extensions', device.type)}), "
          f"{torch.get_num_threads()} threads, vocab {args.vocab}, "
          f"mix {args.mix}: {MIXES[args.mix]}")  # fmt: skip
    print("| N | together ms | row by row ms | speedup | same tokens |")
    print("|---|---|---|---|---|")
    results = []
    for n in args.num_requests:
        r = measure(n, args, device)
        results.append(r)
        print(f"| {n} | {r['together_ms']} | {r['row_by_row_ms']} | {r['speedup']}x "
              f"| {r['same_tokens']} |", flush=True)  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(device=str(device), machine=machine, args=vars(args),
                           results=results), f, indent=1)  # fmt: skip
    return 0 if all(r["same_tokens"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
