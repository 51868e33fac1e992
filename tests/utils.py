"""Starting the real server for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import requests

from vllm.v1.metrics.reader import scrape_metrics


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`vllm serve` in a subprocess on a free loopback port."""

    def __init__(
        self, *args: str, timeout_s: float = 240.0, log_path: str | None = None, env=None
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
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
        if log_path:
            self.log = open(log_path, "w")
        else:
            self.log = open(os.devnull, "w") if os.environ.get("CI") else None
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not start")

    def client(self, **kw):
        import openai

        return openai.OpenAI(
            base_url=self.base + "/v1",
            api_key=kw.pop("api_key", "x"),
            max_retries=0,
            timeout=kw.pop("timeout", 120),
            **kw,
        )

    def metrics(self) -> dict[str, float]:
        """Sample name -> value (labels dropped; one model per server)."""
        return scrape_metrics(self.base)

    def wait_metric(self, name: str, value: float, timeout_s: float = 20.0) -> float:
        deadline = time.monotonic() + timeout_s
        got = None
        while time.monotonic() < deadline:
            got = self.metrics().get(name)
            if got == value:
                return got
            time.sleep(0.2)
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self.log:
            self.log.close()
