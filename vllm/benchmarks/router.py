"""N `vllm serve` replicas on loopback ports behind vLLM's own router (``vllm-router``).

    python -m vllm.benchmarks.router --replicas 2 --policy consistent_hash -- \\
        --scheduling-policy continuum --num-gpu-blocks-override 256

Each replica is a ``RemoteServer`` (its own process group, a free 127.0.0.1 port,
``VLLM_CPU_THREADS`` threads); the router (``python -m vllm_router.launch_router``, from
the ``vllm-router`` wheel) listens on ``--port`` and forwards to them. Ctrl-C, SIGTERM or
SIGHUP stops the router, then every replica's whole process group: nothing is left.
docs/router.md says which identity routes a job (``X-Session-ID``) and pins it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import requests

from vllm.benchmarks.server import RemoteServer, stop_session
from vllm.entrypoints.utils import LOOPBACK, get_open_port

# The router's load-balancing policies in vllm-router 0.1.17 (its --policy choices).
ROUTING_POLICIES = (
    "consistent_hash",
    "round_robin",
    "random",
    "power_of_two",
    "cache_aware",
    "kv_aware",
    "sticky_least_loaded",
)
# A replica killed mid-run must cost its jobs seconds, not the router's defaults (a
# health check every 60 s, 3 failures to mark it down): a request to it is retried and,
# once its circuit opens after 3 failures, re-hashed onto the healthy replicas.
FAST_FAILOVER = (
    "--health-check-interval-secs", "2",
    "--health-failure-threshold", "2",
    "--cb-failure-threshold", "3",
    "--retry-max-retries", "5",
    "--retry-initial-backoff-ms", "200",
    "--retry-max-backoff-ms", "1000",
)  # fmt: skip


def router_installed() -> bool:
    """Whether the ``vllm-router`` wheel (``pip install vllm-router==0.1.17``) is here."""
    return importlib.util.find_spec("vllm_router") is not None


class ReplicaSet:
    """``replicas`` servers with ``serve_args`` and the router in front (``policy``).

    ``base`` is the router's URL; ``replicas[i].base`` each replica's. ``stop()`` (also
    on leaving a ``with`` block) ends the router and every replica. ``RuntimeError``
    (everything already stopped) if a replica or the router does not come up.
    """

    def __init__(
        self,
        replicas: int,
        serve_args: Sequence[str] = (),
        policy: str = "consistent_hash",
        router_args: Sequence[str] = (),
        port: int | None = None,
        threads_per_replica: int = 1,
        log_dir: str | None = None,
        timeout_s: float = 240.0,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {ROUTING_POLICIES}, got {policy!r}")
        if not router_installed():
            raise RuntimeError("vllm-router is not installed: pip install vllm-router==0.1.17")
        self.replicas: list[RemoteServer] = []
        self.router: subprocess.Popen | None = None
        self._log: IO[str] | None = None
        env = {**os.environ, "VLLM_CPU_THREADS": str(threads_per_replica)}
        logs = Path(log_dir) if log_dir else None
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(replicas):  # all load at once
                log = str(logs / f"replica{i}.log") if logs else None
                server = RemoteServer(
                    *serve_args, timeout_s=timeout_s, log_path=log, env=env, wait=False
                )
                self.replicas.append(server)
            for server in self.replicas:
                server.wait_healthy()
            self.port = port or get_open_port()
            self.base = f"http://{LOOPBACK}:{self.port}"
            self._start_router(policy, router_args, logs, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start_router(self, policy, router_args, logs: Path | None, timeout_s: float) -> None:
        cmd = [
            sys.executable, "-m", "vllm_router.launch_router",
            "--host", LOOPBACK,
            "--port", str(self.port),
            "--worker-urls", *(r.base for r in self.replicas),
            "--policy", policy,
            "--prometheus-host", LOOPBACK,
            "--prometheus-port", str(get_open_port()),
            "--worker-startup-check-interval", "1",
            *FAST_FAILOVER,
            *router_args,
        ]  # fmt: skip
        self._log = open(logs / "router.log", "w") if logs else open(os.devnull, "w")
        self.router = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.router.returncode}")
            try:
                if requests.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"vllm-router did not start in {timeout_s:g} s")

    def stop(self) -> None:
        """The router first (no new request reaches a stopping replica), then each
        replica's process group; safe to call twice."""
        if self.router is not None:
            stop_session(self.router, grace_s=10)
        if self._log:
            self._log.close()
            self._log = None
        for server in self.replicas:
            server.stop()

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm.benchmarks.router",
        description="N vllm serve replicas behind vllm-router; the arguments after -- go "
        "to every `vllm serve`.",
    )
    parser.add_argument("--replicas", type=int, default=2, help="how many `vllm serve`")
    parser.add_argument("--policy", choices=ROUTING_POLICIES, default="consistent_hash")
    parser.add_argument("--port", type=int, default=8000, help="the router's port")
    parser.add_argument(
        "--threads-per-replica", type=int, default=1, help="VLLM_CPU_THREADS of each replica"
    )
    parser.add_argument("--log-dir", default=None, help="replica<i>.log and router.log here")
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="one more vllm-router argument (repeat: --router-arg=--queue-size --router-arg=8)",
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="start-up limit, s")
    return parser


def _watch(fleet: ReplicaSet) -> int:
    """Serve until the router exits or the last replica does (the router fails the jobs
    of a dead replica over to the others); 1 then, after saying which."""
    dead: set[int] = set()
    while fleet.router is not None and fleet.router.poll() is None:
        for i, replica in enumerate(fleet.replicas):
            if i not in dead and replica.proc.poll() is not None:
                dead.add(i)
                print(f"replica {i} exited ({replica.proc.returncode})", file=sys.stderr)
        if len(dead) == len(fleet.replicas):
            print("every replica exited; stopping the router", file=sys.stderr)
            return 1
        time.sleep(1.0)
    print("vllm-router exited; stopping the replicas", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = make_parser().parse_args(argv[:split])
    serve_args = argv[split + 1 :]

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        with ReplicaSet(
            args.replicas,
            serve_args,
            policy=args.policy,
            router_args=args.router_arg,
            port=args.port,
            threads_per_replica=args.threads_per_replica,
            log_dir=args.log_dir,
            timeout_s=args.timeout,
        ) as fleet:
            for i, replica in enumerate(fleet.replicas):
                print(f"replica {i}: {replica.base}", flush=True)
            print(f"vllm-router ({args.policy}): {fleet.base}  (Ctrl-C stops all)", flush=True)
            return _watch(fleet)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
