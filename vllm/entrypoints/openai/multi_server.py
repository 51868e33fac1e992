"""``vllm serve --api-server-count N`` (N > 1): N API server processes, one engine core.

One API server spends tens of microseconds of its CPU per streamed token (HTTP, JSON,
detokenizing: docs/serving.md), so one process carries a bounded number of tokens a
second, whatever the engine behind it could produce. As in vLLM, more API server
processes share the load, each with its own event loop, in front of the same engine:

    vllm serve      binds the port, starts the others, watches them, forwards signals
    ├── EngineCore  one PULL socket over every API server's input, a PUSH to each output
    ├── APIServer-0 accepts on the shared listening socket, binds its own ZMQ pair
    └── APIServer-1 ...

With ``--data-parallel-size N`` there are N engine cores (each its rank's device or share
of the CPU), each with a socket pair per API server, and each API server balances over
all of them with one job table and load view in shared memory (``dp_client.py``).

Every API server accepts on the one listening socket bound here (the kernel hands each
new connection to one of them). Each request's outputs come back to the API server that
sent it (``EngineCoreRequest.client_index``); every step's scheduler stats go to all of
them, and API server 0 alone records the engine's Prometheus series. ``/metrics`` from
any of them reads every server's series (prometheus_client's multiprocess mode, in this
run's folder), and the Responses API's stored responses live in one SQLite file that all
of them share, so a ``previous_response_id`` may land on any server.

Lifetimes: the engines' death pipes are held here, so no engine outlives this
process; each API server watches a death pipe of this process too. If an engine or any
API server exits unexpectedly, everything stops and the exit status is 1 (with
``--keep-alive-on-engine-death`` the API servers outlive the engine, answering 503).
SIGINT or SIGTERM here is forwarded once to each API server (they drain as one would);
a second one ends them at once. The API servers run in their own process group, so a
terminal's Ctrl-C reaches them through this process only, once.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait

from vllm.config import VllmConfig
from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.entrypoints.openai.responses_store import SharedResponseStore
from vllm.v1.engine.admission_control import SharedAdmissionStats
from vllm.v1.engine.core_client import EngineLink, start_engine_process
from vllm.v1.engine.dp_client import DPLink, SharedJobTable, dp_engine_envs

logger = logging.getLogger("vllm.serve")

ENGINE_DEATH_GRACE_S = 10.0  # API servers exit by themselves this long after the engine
STOP_TIMEOUT_S = 10.0  # after the drain: how long an API server has to exit
PARENT_GONE_GRACE_S = 10.0  # an API server whose parent died exits this long after


def run_multi_api_server(
    vllm_config: VllmConfig, frontend: FrontendArgs, sock: socket.socket, count: int
) -> int:
    """Start the engine and ``count`` API servers on ``sock``; serve until a signal or a
    death; the exit status (0 after a signal, 1 if a process failed)."""
    run_dir = tempfile.mkdtemp(prefix="vllm-continuum-")
    metrics_dir = os.path.join(run_dir, "metrics")
    os.mkdir(metrics_dir)
    ranks = vllm_config.parallel_config.data_parallel_size
    # Rank r's sockets for API server i: input-r-i, output-r-i.
    inputs = [[f"ipc://{os.path.join(run_dir, f'input-{r}-{i}')}" for i in range(count)]
              for r in range(ranks)]  # fmt: skip
    outputs = [[f"ipc://{os.path.join(run_dir, f'output-{r}-{i}')}" for i in range(count)]
               for r in range(ranks)]  # fmt: skip
    store_path = os.path.join(run_dir, "responses.sqlite")
    SharedResponseStore(store_path).close()  # created once, before its users start
    spawn = multiprocessing.get_context("spawn")
    alive = [spawn.Pipe(duplex=False) for _ in range(ranks)]  # (reader, writer) a rank
    log_level = logging.getLogger("vllm").getEffectiveLevel()
    engines: list[multiprocessing.process.BaseProcess] = []
    engine_deaths: list[Connection] = []
    servers: list[multiprocessing.process.BaseProcess] = []
    parent_deaths: list[Connection] = []
    supervisor = _Supervisor()
    saved_metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")  # a user's, restored
    try:
        if ranks > 1:
            logger.info("Starting %d engine cores (data parallel) and %d API servers",
                        ranks, count)  # fmt: skip
            envs = dp_engine_envs(ranks)
        else:
            logger.info("Starting the engine core and %d API servers", count)
            envs = [None]
        for rank, env in enumerate(envs):
            engine, death = start_engine_process(
                vllm_config, inputs[rank], outputs[rank], keepalive=alive[rank][1], env=env
            )
            engines.append(engine)
            engine_deaths.append(death)
        # Read by prometheus_client when it is imported: the API servers' alone.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        # The queued-request limit is global (vLLM's rule): the servers publish their
        # counts in shared memory. The token limit is each server's own.
        counters = None
        if vllm_config.scheduler_config.max_num_queued_reqs is not None:
            counters = spawn.RawArray("q", SharedAdmissionStats.num_counters(count))
        if ranks > 1:  # what the servers share to place requests (dp_client.py)
            jobs = SharedJobTable(spawn)
            sent_counters = spawn.RawArray("q", ranks * count)
        for i in range(count):
            reader, writer = spawn.Pipe(duplex=False)
            rank_links = [
                EngineLink(inputs[r][i], outputs[r][i], i, alive[r][0], counters, count)
                for r in range(ranks)
            ]
            link = rank_links[0] if ranks == 1 else DPLink(rank_links, jobs, sent_counters)
            server = spawn.Process(
                target=run_api_server_process,
                args=(vllm_config, frontend, sock, link, store_path, reader, log_level),
                name=f"APIServer-{i}",
                daemon=True,
            )
            server.start()
            reader.close()
            servers.append(server)
            parent_deaths.append(writer)
        # From here only the engines hold their keepalives' write ends, and only the API
        # servers the read ends.
        for conn in itertools.chain.from_iterable(alive):
            conn.close()
        return supervisor.watch(engines, servers, frontend.keep_alive_on_engine_death)
    finally:
        if saved_metrics_dir is not None:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved_metrics_dir
        else:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        supervisor.stop(servers)
        for conn in (*itertools.chain.from_iterable(alive), *parent_deaths):
            conn.close()  # closing twice is a no-op
        for death in engine_deaths:
            death.close()  # each engine's loop ends at its pipe's EOF
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for engine in engines:
            engine.join(max(deadline - time.monotonic(), 0.1))
            if engine.is_alive():
                logger.warning("%s did not stop in %.0f s; killing it", engine.name,
                               STOP_TIMEOUT_S)  # fmt: skip
                engine.kill()
                engine.join()
        shutil.rmtree(run_dir, ignore_errors=True)


class _Supervisor:
    """Waits on the processes' sentinels; SIGINT/SIGTERM become SIGTERMs to the API
    servers (the first starts their drain, a second ends them now)."""

    def __init__(self) -> None:
        self.signals = 0
        self._servers: list[multiprocessing.process.BaseProcess] = []

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        name = signal.Signals(signum).name
        logger.info("%s received: %s", name, "draining" if self.signals == 1 else "ending now")
        self._terminate(self._servers)

    @staticmethod
    def _terminate(servers) -> None:
        for server in servers:
            if server.is_alive():
                server.terminate()  # SIGTERM: the API server's own drain

    def watch(self, engines, servers, keep_alive_on_engine_death: bool) -> int:
        """Until every API server is gone, or one failed, or an engine died (any of the
        data-parallel ranks: the engine as a whole is dead); the exit status."""
        self._servers = servers
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        engine_dead_at: float | None = None
        while True:
            running = [s for s in servers if s.is_alive()]
            if not running:
                failed = any(s.exitcode != 0 for s in servers) or engine_dead_at is not None
                return 1 if failed and not self.signals else 0
            dead = [e for e in engines if not e.is_alive()]
            if engine_dead_at is None and dead:
                engine_dead_at = time.monotonic()
                if not self.signals:
                    rank = f" of rank {engines.index(dead[0])}" if len(engines) > 1 else ""
                    logger.error("The engine core%s exited (exit code %s)", rank,
                                 dead[0].exitcode)  # fmt: skip
            if (
                engine_dead_at is not None
                and not keep_alive_on_engine_death
                and time.monotonic() - engine_dead_at > ENGINE_DEATH_GRACE_S
            ):
                return 1  # they exit by themselves (their watchdog); ``stop`` ends the rest
            if not self.signals and len(running) < len(servers):
                for s in servers:
                    if not s.is_alive():
                        logger.error("%s exited (exit code %s): stopping", s.name, s.exitcode)
                return 1
            watched = [s.sentinel for s in running]
            if engine_dead_at is None:  # once dead, its sentinel stays ready: no spin
                watched += [e.sentinel for e in engines]
            wait(watched, timeout=1.0)

    def stop(self, servers) -> None:
        """Drain what still runs, then end it: SIGTERM, a second SIGTERM, SIGKILL."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)  # the stop below must not be cut short
        for attempt in range(3):
            running = [s for s in servers if s.is_alive()]
            if not running:
                return
            if attempt < 2:
                self._terminate(running)
            else:
                for s in running:
                    logger.warning("%s did not stop; killing it", s.name)
                    s.kill()
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for s in running:
                s.join(max(deadline - time.monotonic(), 0.1))


def run_api_server_process(
    vllm_config: VllmConfig,
    frontend: FrontendArgs,
    sock: socket.socket,
    link: EngineLink | DPLink,
    store_path: str,
    parent_death: Connection,
    log_level: int,
) -> None:
    """An API server's process entry point (spawn): ``run_server`` on the shared socket,
    attached to the engine by ``link``."""
    import asyncio

    from vllm.entrypoints.cli.serve import (
        _raise_terminated,
        _Terminated,
        event_loop_factory,
        raise_fd_limit,
    )
    from vllm.entrypoints.openai.api_server import run_server
    from vllm.v1.engine.core_client import EngineStartupError

    index = link.client_index
    logging.basicConfig(
        level=log_level,
        format=f"%(levelname)s %(asctime)s [api {index}] %(name)s: %(message)s",
    )
    os.setpgrp()  # signals come from the parent, once (see the module docstring)
    signal.signal(signal.SIGTERM, _raise_terminated)  # until the launcher takes over
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise_fd_limit()
    threading.Thread(
        target=_exit_when_parent_gone, args=(parent_death,), name="ParentDeathPipe", daemon=True
    ).start()
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            status = runner.run(
                run_server(vllm_config, frontend, sock, link=link, response_store=store_path)
            )
    except EngineStartupError as e:
        if index == 0:  # one line, not one per API server
            print(f"vllm serve: error: {e}", file=sys.stderr)
        status = 1
    except (KeyboardInterrupt, _Terminated):
        status = 0
    sys.exit(status)


def _exit_when_parent_gone(parent_death: Connection) -> None:
    """Thread: at the parent's death pipe's EOF, drain (SIGTERM to this process); exit
    regardless ``PARENT_GONE_GRACE_S`` later."""
    try:
        while True:
            parent_death.recv_bytes()
    except (EOFError, OSError):
        pass
    logger.warning("the vllm serve process is gone; this API server exits")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(PARENT_GONE_GRACE_S)
    os._exit(1)
