"""``vllm run-batch -i requests.jsonl -o results.jsonl [engine flags]``: OpenAI's batch
file format run offline (``vllm/entrypoints/openai/run_batch.py``). Only argparse and the
config modules are imported at parse time."""

from __future__ import annotations

import argparse
import logging
import sys

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.cli_args import FrontendArgs


def add_run_batch_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run-batch",
        help="Run a batch file of OpenAI requests (JSONL) offline.",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "-i", "--input-file", required=True, help="The requests, a JSONL file (- for stdin)."
    )
    p.add_argument("-o", "--output-file", required=True, help="The results, JSONL (- for stdout).")
    p.add_argument("--max-concurrency", type=int, default=128, help="Requests in flight at once.")
    FrontendArgs.add_cli_args(p)  # tool calling, reasoning, limits: as vllm serve's
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run, model_tag=None)
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    from vllm.entrypoints.cli.serve import build_config
    from vllm.entrypoints.logger import set_log_level

    try:
        if args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        frontend = FrontendArgs.from_cli_args(args)
        set_log_level(frontend.log_level)
        vllm_config = build_config(args)
    except ValueError as e:
        parser.exit(2, f"vllm run-batch: error: {e}\n")
    import asyncio

    from vllm.entrypoints.openai.run_batch import run_batch

    try:
        status = asyncio.run(
            run_batch(
                vllm_config, frontend, args.input_file, args.output_file, args.max_concurrency
            )
        )
    except OSError as e:
        print(f"vllm run-batch: error: {e}", file=sys.stderr)
        status = 1
    sys.exit(status)
