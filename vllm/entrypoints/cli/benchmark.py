"""``vllm bench serve``: vLLM's serving benchmark against a running server
(``vllm/benchmarks/serve.py``); ``vllm bench latency`` / ``throughput``: its offline ones,
the engine in process (``vllm/benchmarks/offline.py``). Only argparse and the config
modules are imported at parse time."""

from __future__ import annotations

import argparse
import sys


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="Benchmark a running server (vllm bench serve).",
        description="Benchmarks, with vLLM's flags and result format.",
    )
    kinds = p.add_subparsers(
        dest="bench_command", metavar="{serve,latency,throughput}", required=True
    )
    serve = kinds.add_parser(
        "serve",
        help="Online serving benchmark: request rate, concurrency, TTFT / TPOT / ITL.",
        description="Online serving benchmark against an OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from vllm.benchmarks.serve import add_cli_args

    add_cli_args(serve)
    serve.set_defaults(func=run_bench_serve)
    add_offline_parsers(kinds)
    return p


def run_bench_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from vllm.benchmarks.serve import main

    try:
        status = main(args)
    except ValueError as e:  # a bad flag value or dataset: one line, as argparse's
        print(f"vllm bench serve: error: {e}", file=sys.stderr)
        status = 2
    except RuntimeError as e:  # the server refused a warm-up or the profiler: one line
        print(f"vllm bench serve: error: {e}", file=sys.stderr)
        status = 1
    sys.exit(status)


def add_offline_parsers(kinds) -> None:
    """``vllm bench latency`` and ``vllm bench throughput`` (vllm/benchmarks/offline.py)."""
    from vllm.benchmarks import offline

    for name, add_args, what in (
        ("latency", offline.add_latency_args, "Latency of one batch, the engine in process."),
        ("throughput", offline.add_throughput_args, "Offline throughput, the engine in process."),
    ):
        p = kinds.add_parser(
            name,
            help=what,
            description=what,
            formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        )
        add_args(p)
        p.set_defaults(func=run_offline, bench_run=getattr(offline, name))


def run_offline(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        args.bench_run(args)
    except ValueError as e:
        print(f"vllm bench {args.bench_command}: error: {e}", file=sys.stderr)
        sys.exit(2)
