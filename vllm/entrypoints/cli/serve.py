"""``vllm serve``: start the OpenAI-compatible server (engine core in its own process)."""

from __future__ import annotations

import argparse
import logging
import time

from vllm.config import DEFAULT_MODEL
from vllm.engine.arg_utils import EngineArgs

logger = logging.getLogger("vllm.serve")


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help="Model: the embedded name, a .gguf file, or an HF folder.",
    )
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--host", default="127.0.0.1", help="Host to bind.")
    p.add_argument("--port", type=int, default=8000, help="Port to bind.")
    p.add_argument("--api-key", default=None, help="Require this key as a Bearer token.")
    p.add_argument("--disable-log-requests", action="store_true", help="Do not log requests.")
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of uvicorn.",
    )
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import uvicorn

    from vllm.entrypoints.openai.api_server import build_app, dump_config

    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    if args.model_flag:
        args.model = args.model_flag
    start = time.monotonic()
    try:
        from vllm.model_executor.model_loader import get_model_config

        engine_args = EngineArgs.from_cli_args(args)
        hf_config = get_model_config(engine_args.model)
        vllm_config = engine_args.create_engine_config(hf_config.max_position_embeddings)
    except ValueError as e:
        parser.exit(2, f"vllm serve: error: {e}\n")
    logger.info(
        "vllm serve %s with config %s", vllm_config.model_config.model, dump_config(vllm_config)
    )
    app = build_app(vllm_config, args)
    logger.info("Starting the engine core (%.1f s so far)", time.monotonic() - start)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
    )
