"""Front-end side of the ZMQ link to the engine-core process."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import pickle
import shutil
import tempfile

import zmq
import zmq.asyncio

from vllm.config import VllmConfig
from vllm.v1.engine.core_proc import EngineFactory, run_engine_core

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served."""


class EngineStartupError(RuntimeError):
    """The engine-core process failed before it was ready."""


def last_line(traceback_text: str) -> str:
    """The exception line of a formatted traceback."""
    lines = traceback_text.strip().splitlines()
    return lines[-1] if lines else "unknown error"


class AsyncMPClient:
    """Starts the engine core in a spawned process and exchanges pickled messages.

    The sockets are IPC endpoints in a private temporary folder (never a network port).
    ``engine_factory`` (a picklable module-level callable) replaces ``EngineCore`` in tests.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        startup_timeout_s: float = 600.0,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="vllm-continuum-")
        in_addr = f"ipc://{os.path.join(self._dir, 'input')}"
        out_addr = f"ipc://{os.path.join(self._dir, 'output')}"
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(in_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(out_addr)
        spawn = multiprocessing.get_context("spawn")  # torch + fork is unsafe
        self.proc = spawn.Process(
            target=run_engine_core,
            args=(
                vllm_config,
                in_addr,
                out_addr,
                logging.getLogger("vllm").getEffectiveLevel(),
                engine_factory,
            ),
            name="EngineCore",
            daemon=True,
        )
        self.proc.start()
        self.startup_timeout_s = startup_timeout_s
        self.dead_reason: str | None = None
        self.info: dict = {}

    async def wait_ready(self) -> dict:
        """Wait for the engine's "ready" (model loaded, KV cache allocated)."""
        deadline = asyncio.get_running_loop().time() + self.startup_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(self.output.recv(), 0.5)
            except TimeoutError:
                msg = None
            if msg is not None:
                kind, payload = pickle.loads(msg)
                if kind == "ready":
                    self.info = payload
                    return payload
                if kind == "fatal":  # the traceback is in the engine's log already
                    raise EngineStartupError(f"engine core failed to start: {last_line(payload)}")
            if not self.proc.is_alive():
                raise EngineStartupError(f"engine core exited with code {self.proc.exitcode}")
            if asyncio.get_running_loop().time() > deadline:
                raise EngineStartupError("engine core did not start in time")

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.proc.is_alive()

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(
                self.dead_reason or f"the engine core process died (exit code {self.proc.exitcode})"
            )

    async def send(self, kind: str, payload) -> None:
        self._check_alive()
        await self.input.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    async def recv(self, timeout_s: float = 1.0):
        """The next (kind, payload) message, or None on timeout; raises if the engine died."""
        try:
            # recv() itself, not poll()+recv(): the socket's FD is edge-triggered, and a
            # poll can miss messages that queued up behind the one just read.
            return pickle.loads(await asyncio.wait_for(self.output.recv(), timeout_s))
        except TimeoutError:
            pass
        if not self.proc.is_alive():
            self.dead_reason = f"the engine core process died (exit code {self.proc.exitcode})"
            raise EngineDeadError(self.dead_reason)
        return None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if self.proc.is_alive():
            try:
                sent = self.input.send(pickle.dumps(("shutdown", None)), flags=zmq.NOBLOCK)
                if isinstance(sent, asyncio.Future) and sent.done():
                    sent.exception()  # retrieved: no "exception never retrieved" noise
            except zmq.ZMQError:
                pass
            self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout_s)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
