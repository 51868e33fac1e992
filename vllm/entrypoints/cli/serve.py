"""``vllm serve``: start the OpenAI-compatible server (engine core in its own process).

Only argparse and the config modules are imported at parse time, so ``--help`` and flag
errors are instant; torch, transformers and FastAPI load once the flags are valid.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import stat
import sys
import time

from vllm import envs
from vllm.engine.arg_utils import EngineArgs, UsageContext
from vllm.entrypoints.openai.cli_args import FrontendArgs

logger = logging.getLogger("vllm.serve")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description="Start the OpenAI-compatible API server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # vLLM's positional MODEL; when given it wins over --model (ModelConfig's flag).
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="model",
        help="Model: the embedded name, a .gguf file, or an HF folder; overrides --model.",
    )
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="Flags from a YAML file (vLLM's): keys are flag names, e.g. 'port: 8000' or "
        "'max_model_len: 4096'; true/false set or clear a switch, a list gives several "
        "values, a mapping a JSON config. The command line wins over the file.",
    )
    FrontendArgs.add_cli_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_serve)
    return p


def build_config(args: argparse.Namespace):
    """The validated ``VllmConfig`` of the parsed flags (ValueError naming the bad one)."""
    from vllm.entrypoints.utils import check_chat_template
    from vllm.model_executor.layers.recurrent import has_recurrent_layers
    from vllm.model_executor.model_loader import get_model_config, model_max_len

    if args.model_tag is not None:
        args.model = args.model_tag
    engine_args = EngineArgs.from_cli_args(args)
    if getattr(args, "tokens_only", False):
        tokens_only(engine_args)
    engine_args.serve_speculators_head()
    check_chat_template(engine_args.chat_template)
    from vllm.entrypoints.openai.tool_calling import ToolCallingConfig

    ToolCallingConfig.from_args(args)  # --enable-auto-tool-choice needs a parser
    hf_config = get_model_config(
        engine_args.model,
        engine_args.parsed("hf_overrides"),
        engine_args.revision,
        engine_args.download_dir,
        engine_args.hf_token,
    )
    config = engine_args.create_engine_config(
        model_max_len(hf_config, engine_args.disable_sliding_window),
        UsageContext.OPENAI_API_SERVER,
        recurrent=has_recurrent_layers(hf_config),
    )
    if args.disable_log_requests:  # the engine's per-job lines are request logs too
        policy = dataclasses.replace(config.policy_config, log_jobs=False)
        config = dataclasses.replace(config, policy_config=policy)
    return config


def tokens_only(engine_args: EngineArgs) -> None:
    """--tokens-only's engine: no tokenizer (vLLM sets skip_tokenizer_init too); the
    flags that name one are refused, naming --tokens-only."""
    named = {"--tokenizer": engine_args.tokenizer, "--chat-template": engine_args.chat_template}
    given = [flag for flag, value in named.items() if value]
    if given:
        raise ValueError(
            f"--tokens-only loads no tokenizer: {' and '.join(given)} cannot be used with it"
        )
    engine_args.skip_tokenizer_init = True
    logger.info("--tokens-only: no tokenizer is loaded (skip_tokenizer_init)")


def check_lora_modules(frontend: FrontendArgs, vllm_config) -> None:
    """--lora-modules checked before the engine starts: --enable-lora, each adapter's
    config readable and within --max-lora-rank (ValueError naming the problem)."""
    from vllm.entrypoints.openai.serving_models import OpenAIServingModels

    lora = vllm_config.lora_config
    OpenAIServingModels(
        vllm_config.model_config.name,
        lora_modules=frontend.lora_modules or (),
        enable_lora=lora.enable_lora,
        max_lora_rank=lora.max_lora_rank,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails in a second, not after it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so; without it
    # Nagle + delayed ACK add 40 ms to every response with a body.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """--uds: a listening Unix socket at ``path``. A socket file there that nothing
    answers on (a killed server's) is replaced; a live server's, or any other file, is an
    ``OSError``."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # stale
        else:
            raise OSError(f"a server is already listening on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from vllm.entrypoints.logger import set_log_level

    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    start = time.monotonic()
    try:
        frontend = FrontendArgs.from_cli_args(args)
        set_log_level(frontend.log_level)  # before the engine starts: it inherits it
        vllm_config = build_config(args)
        check_lora_modules(frontend, vllm_config)
        frontend = resolve_api_server_count(frontend, vllm_config)
    except ValueError as e:
        parser.exit(2, f"vllm serve: error: {e}\n")
    try:
        if frontend.uds is not None:
            sock = bind_unix_socket(frontend.uds)
        else:
            sock = bind_socket(frontend.host, frontend.port)
    except OSError as e:
        where = frontend.uds or f"{args.host}:{args.port}"
        print(f"vllm serve: error: cannot bind {where}: {e}", file=sys.stderr)
        sys.exit(1)
    raise_fd_limit()

    import asyncio

    from vllm.entrypoints.openai.api_server import dump_config, run_server
    from vllm.v1.engine.core_client import EngineStartupError

    logger.info(
        "vllm serve %s with config %s", vllm_config.model_config.model, dump_config(vllm_config)
    )
    logger.info("Starting the engine core (%.1f s so far)", time.monotonic() - start)
    # While the engine starts, SIGTERM is an exception (like KeyboardInterrupt for SIGINT)
    # so run_server's cleanup runs; once serving, the launcher drains on either signal.
    signal.signal(signal.SIGTERM, _raise_terminated)
    if frontend.uds is not None:  # the socket file goes with the server, however it ends
        atexit.register(_unlink_socket, frontend.uds, os.stat(frontend.uds).st_ino)
    if frontend.api_server_count > 1:
        sys.exit(_run_multi(vllm_config, frontend, sock))
    try:
        factory = event_loop_factory()
        logger.info("Event loop: %s", "uvloop" if factory else "asyncio")
        with asyncio.Runner(loop_factory=factory) as runner:
            status = runner.run(run_server(vllm_config, frontend, sock))
    except EngineStartupError as e:
        print(f"vllm serve: error: {e}", file=sys.stderr)
        sys.exit(1)
    except (KeyboardInterrupt, _Terminated):
        status = 0
    logger.info("Shut down")
    sys.exit(status)


def resolve_api_server_count(frontend: FrontendArgs, vllm_config) -> FrontendArgs:
    """``frontend`` with its ``api_server_count`` set: unset, one API server, or one per
    data-parallel rank (vLLM's default) where several can work. ``ValueError`` for a
    count given that cannot."""
    dp = vllm_config.parallel_config.data_parallel_size
    runtime_lora = envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING
    if frontend.api_server_count is None:
        count = 1 if runtime_lora else dp
        if count > 1:
            logger.info("--api-server-count defaults to --data-parallel-size (%d)", dp)
        return dataclasses.replace(frontend, api_server_count=count)
    if frontend.api_server_count > 1 and runtime_lora:
        raise ValueError(
            "--api-server-count > 1 cannot be used with VLLM_ALLOW_RUNTIME_LORA_UPDATING: "
            "an adapter loaded at run time would be known to one API server only "
            "(serve adapters with --lora-modules instead)"
        )
    return frontend


def _unlink_socket(path: str, inode: int) -> None:
    """Remove --uds's socket file, if it is still the one this server bound (``inode``),
    not one a later server bound at the same path."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


def _run_multi(vllm_config, frontend: FrontendArgs, sock: socket.socket) -> int:
    """--api-server-count > 1: this process supervises (multi_server.py); the status."""
    from vllm.entrypoints.openai.multi_server import run_multi_api_server

    try:
        status = run_multi_api_server(vllm_config, frontend, sock, frontend.api_server_count)
    except (KeyboardInterrupt, _Terminated):  # a signal before the API servers started
        status = 0
    logger.info("Shut down")
    return status


def raise_fd_limit() -> None:
    """Soft open-file limit up to the hard one (vLLM does too): each connection is a file
    descriptor, and the default 1024 is a few hundred slow clients away."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            logger.warning("Cannot raise the open-file limit from %d to %d: %s", soft, hard, e)


def event_loop_factory():
    """uvloop's event loop when it is installed (a dependency; vLLM serves on it too), else
    asyncio's default. The API server's per-request work is mostly event-loop callbacks
    (HTTP parsing, ZMQ readiness, responses), which uvloop runs in C."""
    if not envs.VLLM_USE_UVLOOP:
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class _Terminated(BaseException):
    """SIGTERM, as an exception (like KeyboardInterrupt for SIGINT)."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()
