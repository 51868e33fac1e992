"""Front-end side of the ZMQ link to the engine-core process.

The wire contract (sockets, message types, payloads) is in ``vllm/v1/engine/__init__.py``.
This side sends ``EngineCoreRequestType`` messages on the input socket and receives
``EngineCoreOutputType`` messages on the output socket. ``wait_ready`` accepts only READY
or FATAL; after it, the caller (``AsyncLLM``) dispatches what ``recv`` returns. A message
that breaks the contract makes the engine dead to this side (``EngineDeadError``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq
import zmq.asyncio

from vllm import envs
from vllm.config import VllmConfig
from vllm.v1.engine import (
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequestType,
    ProtocolError,
    decode_message,
    encode_message,
)
from vllm.v1.engine.core_proc import EngineFactory, run_engine_core

logger = logging.getLogger(__name__)


DEFAULT_GOMP_SPINCOUNT = "10000"  # see engine_process_env
SHUTDOWN_MESSAGE_WAIT_S = 1.0  # how long shutdown waits on SHUTDOWN before the death pipe


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served."""


class EngineStartupError(RuntimeError):
    """The engine-core process failed before it was ready."""


def engine_process_env() -> dict[str, str]:
    """Environment variables the engine process starts with, on top of this one's.

    libgomp (torch's OpenMP on Linux) keeps its worker threads spinning for 300k
    iterations (milliseconds) after every parallel region. A decode step is hundreds of
    small regions with Python in between, so the spinning holds every core for the whole
    step: the API server's event loop (and anything else on the machine) waits for CPU,
    and when the machine is shared the engine itself collapses (8x32 greedy tokens with 2
    threads under a load of ~3: 8-19 tok/s spinning, 36-45 tok/s with 10k spins, 33-65
    passive). 10k spins (~0.1 ms) still bridge the gaps between back-to-back kernels.
    ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` set by the user win.
    """
    if envs.GOMP_SPINCOUNT is not None or envs.OMP_WAIT_POLICY is not None:
        return {}
    return {"GOMP_SPINCOUNT": DEFAULT_GOMP_SPINCOUNT}


@contextmanager
def _environ(overrides: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``overrides`` while a child process is spawned."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def last_line(traceback_text: str) -> str:
    """The exception line of a formatted traceback."""
    lines = traceback_text.strip().splitlines()
    return lines[-1] if lines else "unknown error"


class AsyncMPClient:
    """Starts the engine core in a spawned process and exchanges typed messages with it.

    The sockets are IPC endpoints in a private temporary folder (never a network port).
    ``engine_factory`` (a picklable module-level callable) replaces ``EngineCore`` in tests.

    The process never outlives this client: it watches the read end of a death pipe whose
    write end only this process holds, closed by ``mark_dead`` and ``shutdown`` (and by
    the kernel if this process dies); ``shutdown`` then reaps it, killing it if it has
    not exited within its grace period.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        startup_timeout_s: float = 600.0,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        self._dir = tempfile.mkdtemp(prefix="vllm-continuum-")
        in_addr = f"ipc://{os.path.join(self._dir, 'input')}"
        out_addr = self.output_addr = f"ipc://{os.path.join(self._dir, 'output')}"
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(in_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(out_addr)
        spawn = multiprocessing.get_context("spawn")  # torch + fork is unsafe
        death_reader, self._death_writer = spawn.Pipe(duplex=False)
        self.proc = spawn.Process(
            target=run_engine_core,
            args=(
                vllm_config,
                in_addr,
                out_addr,
                logging.getLogger("vllm").getEffectiveLevel(),
                engine_factory,
                death_reader,
            ),
            name="EngineCore",
            daemon=True,
        )
        with _environ(engine_process_env()):  # read by libgomp when torch loads
            self.proc.start()
        death_reader.close()  # the child has its copy; EOF must come from our end alone
        self.startup_timeout_s = startup_timeout_s
        self.dead_reason: str | None = None
        self.info: EngineCoreReady | None = None

    async def wait_ready(self) -> EngineCoreReady:
        """Wait for the engine's READY (model loaded, KV cache allocated)."""
        deadline = asyncio.get_running_loop().time() + self.startup_timeout_s
        while True:
            try:
                frames = await asyncio.wait_for(self.output.recv_multipart(), 0.5)
            except TimeoutError:
                frames = None
            if frames is not None:
                try:
                    msg_type, payload = decode_message(EngineCoreOutputType, frames)
                except ProtocolError as e:
                    raise EngineStartupError(f"engine core protocol error: {e}") from e
                match msg_type:
                    case EngineCoreOutputType.READY:
                        self.info = payload
                        return payload
                    case EngineCoreOutputType.FATAL:  # the traceback is in the engine's log
                        raise EngineStartupError(
                            f"engine core failed to start: {last_line(payload)}"
                        )
                    case _:
                        raise EngineStartupError(f"engine core sent {msg_type.name} before READY")
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

    def mark_dead(self, reason: str) -> EngineDeadError:
        """Record why the engine is unusable (``is_alive`` turns false); the error to raise.

        The process is told to go (the death pipe closes): a live engine this side no
        longer trusts must not keep its memory. ``shutdown`` reaps it.
        """
        self.dead_reason = reason
        self._death_writer.close()
        return EngineDeadError(reason)

    async def send(self, msg_type: EngineCoreRequestType, payload: Any) -> None:
        """Queue one message; ``ProtocolError`` (nothing sent) if the payload is mistyped."""
        self._check_alive()
        await self.input.send_multipart(encode_message(msg_type, payload))

    async def recv(self, timeout_s: float = 1.0) -> tuple[EngineCoreOutputType, Any] | None:
        """The next (type, payload) message, or None on timeout.

        ``EngineDeadError`` if the engine process died or sent a message that breaks the
        contract.
        """
        try:
            # recv itself, not poll()+recv(): the socket's FD is edge-triggered, and a
            # poll can miss messages that queued up behind the one just read.
            frames = await asyncio.wait_for(self.output.recv_multipart(), timeout_s)
        except TimeoutError:
            if not self.proc.is_alive():
                raise self.mark_dead(
                    f"the engine core process died (exit code {self.proc.exitcode})"
                ) from None
            return None
        try:
            return decode_message(EngineCoreOutputType, frames)
        except ProtocolError as e:
            raise self.mark_dead(f"protocol error from the engine core: {e}") from e

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine and reap its process: SHUTDOWN, the death pipe, then signals.

        Returns once the process is gone. Its SIGTERM is ignored by design (the front end
        owns the signals), so a process that outlives both the message and the death pipe
        is killed.
        """
        if self.proc.is_alive():
            try:
                frames = encode_message(EngineCoreRequestType.SHUTDOWN, None)
                sent = self.input.send_multipart(frames, flags=zmq.NOBLOCK)
                if isinstance(sent, asyncio.Future) and sent.done():
                    sent.exception()  # retrieved: no "exception never retrieved" noise
            except zmq.ZMQError:
                pass  # not connected yet, or gone: the death pipe below still ends it
        # The message normally ends it within a step; the death pipe then ends the rest.
        self.proc.join(min(SHUTDOWN_MESSAGE_WAIT_S, timeout_s))
        self._death_writer.close()
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            logger.warning("engine core did not stop in %.0f s; killing it", timeout_s)
            self.proc.terminate()
            self.proc.join(1.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
