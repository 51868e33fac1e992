"""``vllm bench serve``: vLLM's serving benchmark against a running server
(``vllm/benchmarks/serve.py``). Only argparse is imported at parse time."""

from __future__ import annotations

import argparse
import sys


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="Benchmark a running server (vllm bench serve).",
        description="Benchmarks, with vLLM's flags and result format.",
    )
    kinds = p.add_subparsers(dest="bench_command", metavar="{serve}", required=True)
    serve = kinds.add_parser(
        "serve",
        help="Online serving benchmark: request rate, concurrency, TTFT / TPOT / ITL.",
        description="Online serving benchmark against an OpenAI-compatible server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from vllm.benchmarks.serve import add_cli_args

    add_cli_args(serve)
    serve.set_defaults(func=run_bench_serve)
    return p


def run_bench_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from vllm.benchmarks.serve import main

    try:
        status = main(args)
    except ValueError as e:  # a bad flag value or dataset: one line, as argparse's
        print(f"vllm bench serve: error: {e}", file=sys.stderr)
        status = 2
    sys.exit(status)
