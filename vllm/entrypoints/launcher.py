"""Serving the app with uvicorn: connection read timeouts, the drain on SIGTERM/SIGINT and
the exit when the engine dies (so a supervisor restarts the server).

Lifecycle of ``serve_http``::

    serving --signal--> draining (new /v1 requests 503, /health 503; running ones go on)
            --no request left, or shutdown_timeout, or a 2nd signal--> closing (requests
              still running end with a 503 error / error event) --> uvicorn shutdown
    serving --engine died--> uvicorn shutdown, exit status 1 (unless keep-alive is asked)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn

from vllm.entrypoints.openai.cli_args import FrontendArgs
from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("vllm.entrypoints.launcher")

WATCHDOG_INTERVAL_S = 1.0  # how often engine death is checked
# After the drain: how long uvicorn waits for the responses ended with an error to flush.
FLUSH_TIMEOUT_S = 5


class ServerShuttingDownError(RuntimeError):
    """The request was cut short because the server is shutting down (503)."""

    status = 503
    err_type = "ServiceUnavailableError"


@dataclass
class ServerState:
    """What the app and the launcher share. ``active``: /v1 requests in flight (counted by
    the middleware until their response is complete)."""

    draining: bool = False  # refuse new requests; health 503
    closing: bool = False  # the drain is over: running requests end with an error
    active: int = 0
    exit_code: int = 0

    def check_open(self) -> None:
        """``ServerShuttingDownError`` once the drain is over (no new engine request)."""
        if self.closing:
            raise ServerShuttingDownError("The server is shutting down.")


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is a dependency; without it, uvicorn's h11 as is
    HttpToolsProtocol = None


def read_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol, closing a connection that has not delivered a whole
    request ``timeout_s`` after it opened or after its previous response ended.

    uvicorn itself times out only idle keep-alive connections: a client that sends half a
    request line and waits holds its file descriptor forever (slowloris).
    """
    if HttpToolsProtocol is None:
        logger.warning("httptools is missing: no --request-read-timeout")
        return "auto"
    return type(
        "ReadTimeoutProtocol", (_ReadTimeoutMixin, HttpToolsProtocol), {"timeout_s": timeout_s}
    )


class _ReadTimeoutMixin:
    """The timer: armed when a connection opens and after each response, disarmed once a
    whole request is in (the app may then take its time to answer)."""

    timeout_s: float
    _read_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: ``serve_http`` owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_http(
    app, sock: socket.socket, engine: AsyncLLM, args: FrontendArgs, state: ServerState
) -> int:
    """Serve ``app`` on ``sock`` until a signal or the engine's death; the exit status."""
    config = uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
        access_log=not args.disable_log_requests,
        http=read_timeout_protocol(args.request_read_timeout),
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        logger.info("%s received: %s", sig.name, "draining" if signals == 1 else "ending now")
        stop.set()
        if signals > 1:
            state.closing = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    tasks = [
        asyncio.create_task(_drain_on_signal(stop, server, engine, args, state)),
        asyncio.create_task(_watchdog(server, engine, args, state)),
    ]
    try:
        await server.serve(sockets=[sock])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for task in tasks:
            task.cancel()
    return state.exit_code


async def _drain_on_signal(
    stop: asyncio.Event, server: uvicorn.Server, engine: AsyncLLM, args, state: ServerState
) -> None:
    await stop.wait()
    state.draining = True
    deadline = asyncio.get_running_loop().time() + args.shutdown_timeout
    while state.active and not state.closing and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    if state.active:
        logger.warning("Ending %d request(s) still running at shutdown", state.active)
    state.closing = True
    engine.fail_all(ServerShuttingDownError("The server is shutting down."))
    server.should_exit = True


async def _watchdog(server: uvicorn.Server, engine: AsyncLLM, args, state: ServerState) -> None:
    """Exit when the engine process is gone: a server that can only answer 500 is better
    restarted by its supervisor."""
    while engine.is_alive:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    reason = engine.client.dead_reason or f"exit code {engine.client.proc.exitcode}"
    if args.keep_alive_on_engine_death:
        logger.error("The engine core died (%s); serving 503/500 as asked", reason)
        return
    logger.error("The engine core died (%s): the API server exits", reason)
    state.exit_code = 1
    state.draining = state.closing = True
    server.should_exit = True
