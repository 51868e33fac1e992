"""`vllm serve` in a subprocess, for benchmarks, the policy study and end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO

import requests

from vllm.benchmarks.metrics_reader import scrape_metrics
from vllm.benchmarks.utils import openai_base_url
from vllm.entrypoints.utils import LOOPBACK, get_open_port

_PR_SET_PDEATHSIG = 1


def _term_with_parent() -> None:
    """In the child, before exec: SIGTERM when the thread that started it dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so that a server outlives no test run or benchmark
    killed without its clean-ups (SIGKILL, or pytest ended by SIGTERM); the server's own
    death pipes then end its engine and API processes. Elsewhere a no-op."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl: it will not tell us
        os.kill(os.getpid(), signal.SIGTERM)


def popen_session(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` of a server in a session (process group) of its own, which
    ``stop_session`` ends whole, and which is sent SIGTERM if this process dies first.

    Call it from a thread that lives as long as the server (the main thread): Linux sends
    the signal when the starting thread exits."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_term_with_parent, **kwargs)


def stop_session(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the process group a server was started in (``start_new_session``), then
    SIGKILL if it has not exited within ``grace_s``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


class RemoteServer:
    """`vllm serve` on a free loopback port; the constructor returns once /health is 200
    (with ``wait=False`` at once: call ``wait_healthy`` later, so that servers load together).

    Output goes to ``log_path`` if given, else to this process's stdout (nowhere under
    CI, whose logs it would flood). ``stop()`` ends the server's whole process group (the
    API server and its engine core), also when used as a context manager.
    ``ssl_ca``: the server serves HTTPS (``--ssl-certfile``) with a certificate this CA
    file verifies; ``base`` is then ``https://...``.
    """

    def __init__(
        self,
        *args: str,
        timeout_s: float = 240.0,
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
        ssl_ca: str | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.port = get_open_port()
        self.verify: str | bool = ssl_ca or True
        self.base = f"{'https' if ssl_ca else 'http'}://{LOOPBACK}:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            "--port",
            str(self.port),
            "--uvicorn-log-level",
            "warning",
            *args,
        ]
        self.log: IO[str] | None = None
        if log_path:
            self.log = open(log_path, "w")
        elif os.environ.get("CI"):
            self.log = open(os.devnull, "w")
        # A session of its own, so that stop() reaches the engine core too.
        self.proc = popen_session(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        """Return once /health is 200; ``RuntimeError`` (the server stopped) if the server
        exits or is not healthy within the constructor's ``timeout_s``."""
        timeout_s = self.timeout_s
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                health = requests.get(self.base + "/health", timeout=1, verify=self.verify)
                if health.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not start in {timeout_s:g} s")

    @property
    def url_for_openai(self) -> str:
        """The base URL an OpenAI client is given (``.../v1``)."""
        return openai_base_url(self.base)

    def client(self, **kw):
        """A synchronous ``openai.OpenAI`` client for this server (no retries)."""
        import openai

        return openai.OpenAI(
            base_url=self.url_for_openai,
            api_key=kw.pop("api_key", "x"),
            max_retries=0,
            timeout=kw.pop("timeout", 120),
            **kw,
        )

    def served_model(self, api_key: str | None = None) -> str:
        """The first model name /v1/models lists (the served model)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        models = requests.get(
            self.base + "/v1/models", headers=headers, timeout=10, verify=self.verify
        )
        models.raise_for_status()
        return models.json()["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        """Sample name -> value (labels dropped; one model per server)."""
        return scrape_metrics(self.base)

    def wait_metric(self, name: str, value: float, timeout_s: float = 20.0) -> float | None:
        """Poll /metrics until ``name`` equals ``value``; the last value seen otherwise."""
        deadline = time.monotonic() + timeout_s
        got = None
        while time.monotonic() < deadline:
            got = self.metrics().get(name)
            if got == value:
                return got
            time.sleep(0.2)
        return got

    def stop(self) -> None:
        stop_session(self.proc, grace_s=20)
        if self.log:
            self.log.close()
            self.log = None

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
