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
from dataclasses import dataclass
from multiprocessing.connection import Connection
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


@dataclass
class EngineLink:
    """How an API server reaches an engine process it did not start (``vllm serve
    --api-server-count N``, N > 1: the parent process starts the engine and the API
    servers): its own pair of addresses, which it binds as a lone front end would; its
    index among the front ends, which its requests carry; and the read end of the
    engine's keepalive pipe, EOF once the engine process is gone. ``admission_counters``:
    the shared array of every server's queued-request count (``SharedAdmissionStats``),
    when ``--max-num-queued-reqs`` is set; ``client_count``: how many front ends."""

    input_addr: str
    output_addr: str
    client_index: int
    engine_alive: Connection
    admission_counters: Any = None
    client_count: int = 1


def start_engine_process(
    vllm_config: VllmConfig,
    input_addrs: list[str],
    output_addrs: list[str],
    engine_factory: EngineFactory | None = None,
    keepalive: Connection | None = None,
    env: dict[str, str] | None = None,
) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    """Spawn the engine core for these front ends' addresses; the process and the write
    end of its death pipe (closing it, or this process's exit, ends the engine). ``env``:
    variables the process starts with on top of this one's (a data-parallel rank's)."""
    spawn = multiprocessing.get_context("spawn")  # torch + fork is unsafe
    death_reader, death_writer = spawn.Pipe(duplex=False)
    proc = spawn.Process(
        target=run_engine_core,
        args=(
            vllm_config,
            input_addrs,
            output_addrs,
            logging.getLogger("vllm").getEffectiveLevel(),
            engine_factory,
            death_reader,
            keepalive,
        ),
        name="EngineCore",
        daemon=True,
    )
    with _environ({**engine_process_env(), **(env or {})}):  # read when torch loads
        proc.start()
    death_reader.close()  # the child has its copy; EOF must come from our end alone
    return proc, death_writer


class AsyncMPClient:
    """Starts the engine core in a spawned process and exchanges typed messages with it.

    The sockets are IPC endpoints in a private temporary folder (never a network port).
    ``engine_factory`` (a picklable module-level callable) replaces ``EngineCore`` in tests.

    The process never outlives this client: it watches the read end of a death pipe whose
    write end only this process holds, closed by ``mark_dead`` and ``shutdown`` (and by
    the kernel if this process dies); ``shutdown`` then reaps it, killing it if it has
    not exited within its grace period.

    With ``link`` the engine is another process's (one of several API servers): this
    client binds the link's addresses, starts nothing, knows the engine is gone by the
    keepalive pipe's EOF, and its ``shutdown`` leaves the engine to the process that
    started it.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        startup_timeout_s: float = 600.0,
        engine_factory: EngineFactory | None = None,
        link: EngineLink | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if link is None:
            self._dir: str | None = tempfile.mkdtemp(prefix="vllm-continuum-")
            in_addr = f"ipc://{os.path.join(self._dir, 'input')}"
            out_addr = f"ipc://{os.path.join(self._dir, 'output')}"
        else:
            self._dir = None  # the addresses live in the starter's folder
            in_addr, out_addr = link.input_addr, link.output_addr
        self.output_addr = out_addr
        self.client_index = 0 if link is None else link.client_index
        self.ctx = zmq.asyncio.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(in_addr)
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(out_addr)
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._death_writer: Connection | None = None
        self._engine_alive = None if link is None else link.engine_alive
        self._engine_gone = False
        if link is None:
            self.proc, self._death_writer = start_engine_process(
                vllm_config, [in_addr], [out_addr], engine_factory, env=env
            )
        self.startup_timeout_s = startup_timeout_s
        self.dead_reason: str | None = None
        self.info: EngineCoreReady | None = None

    def _engine_running(self) -> bool:
        if self.proc is not None:
            return self.proc.is_alive()
        if not self._engine_gone:
            try:
                self._engine_gone = self._engine_alive.poll()  # readable only at EOF
            except OSError:
                self._engine_gone = True
        return not self._engine_gone

    @property
    def exit_description(self) -> str:
        """How the engine process ended, for messages."""
        if self.proc is not None:
            return f"exit code {self.proc.exitcode}"
        return "its process exited"

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
            if not self._engine_running():
                raise EngineStartupError(f"engine core exited ({self.exit_description})")
            if asyncio.get_running_loop().time() > deadline:
                raise EngineStartupError("engine core did not start in time")

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self._engine_running()

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(
                self.dead_reason or f"the engine core process died ({self.exit_description})"
            )

    def mark_dead(self, reason: str) -> EngineDeadError:
        """Record why the engine is unusable (``is_alive`` turns false); the error to raise.

        The process is told to go (the death pipe closes): a live engine this side no
        longer trusts must not keep its memory. ``shutdown`` reaps it. (An engine this
        client did not start is its starter's to end: this API server exits instead.)
        """
        self.dead_reason = reason
        if self._death_writer is not None:
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
            if not self._engine_running():
                raise self.mark_dead(
                    f"the engine core process died ({self.exit_description})"
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
        is killed. With a ``link`` only the sockets close: the engine serves other API
        servers, and the process that started it ends it.
        """
        if self.proc is None:
            self._close_sockets()
            return
        if self.proc.is_alive():
            try:
                frames = encode_message(EngineCoreRequestType.SHUTDOWN, None)
                sent = self.input.send_multipart(frames, flags=zmq.NOBLOCK)
                if isinstance(sent, asyncio.Future) and sent.done():
                    sent.exception()  # retrieved: no "exception never retrieved" noise
            except (zmq.ZMQError, RuntimeError):
                # Not connected yet, or gone; or an asyncio socket shut down with no event
                # loop to make its send's future in: the death pipe below still ends it.
                pass
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
        self._close_sockets()

    def _close_sockets(self) -> None:
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
