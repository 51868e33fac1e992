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
import json
import logging
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote

import uvicorn

from vllm.entrypoints.openai.cli_args import FrontendArgs, uvicorn_log_config
from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("vllm.entrypoints.launcher")

WATCHDOG_INTERVAL_S = 1.0  # how often engine death is checked
# After the drain: how long uvicorn waits for the responses ended with an error to flush.
FLUSH_TIMEOUT_S = 5


@contextlib.contextmanager
def stop_on_signal_while_starting() -> Iterator[list[signal.Signals]]:
    """SIGINT/SIGTERM during start-up (the engine may take minutes to load) cancel the
    current task; the signals received are in the list yielded.

    On the event loop itself, not ``signal.signal``: uvloop runs a Python-level handler
    from a loop callback, where an exception it raises is logged and dropped, and the
    server went on starting. ``serve_http`` installs its own handlers over these."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        if not received:
            logger.info("%s received while starting: stopping", sig.name)
        received.append(sig)
        task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    yield received


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
    load: int = 0  # --enable-server-load-tracking: model requests in flight (GET /load)
    exit_code: int = 0

    def check_open(self) -> None:
        """``ServerShuttingDownError`` once the drain is over (no new engine request)."""
        if self.closing:
            raise ServerShuttingDownError("The server is shutting down.")


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is a dependency; without it, uvicorn's h11 as is
    HttpToolsProtocol = None


def http_protocol(args: FrontendArgs) -> type[asyncio.Protocol] | str:
    """uvicorn's httptools protocol with the server's connection limits: the read timeout
    (``_ReadTimeoutMixin``) and the bounded request head (``_HeadLimitMixin``)."""
    if HttpToolsProtocol is None:
        logger.warning("httptools is missing: h11, without --request-read-timeout")
        return "auto"
    attrs = {
        "timeout_s": args.request_read_timeout,
        "max_head_bytes": args.max_request_header_size,
        "max_header_count": args.max_request_header_count,
    }
    return type(
        "LimitedHttpProtocol", (_ReadTimeoutMixin, _HeadLimitMixin, HttpToolsProtocol), attrs
    )


class _ReadTimeoutMixin:
    """The timer: armed when a connection opens and after each response, disarmed once a
    whole request is in (the app may then take its time to answer). uvicorn itself times
    out only idle keep-alive connections: a client that sends half a request line and
    waits would hold its file descriptor forever (slowloris)."""

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


class _HeadTooLarge(Exception):
    """Raised in a parser callback to stop parsing a head over the limits."""


class _HeadLimitMixin:
    """Bounds a request's head (request line and headers) in bytes and in header count:
    a larger one gets a JSON 431 and the connection closes.

    httptools itself has no limit and grows a header by concatenation while it arrives
    (one 120 MB header held the event loop 10 s and left the process 255 MB larger).
    Bytes are counted as they arrive while a head is open (from a connection's start or
    the end of the previous request to the end of the headers), so at most
    ``max_head_bytes`` plus one read is ever buffered; the headers' exact size and count
    are checked as the parser reports each one."""

    max_head_bytes: int
    max_header_count: int
    _head_open = True
    _head_bytes = 0  # received while the head is open
    _header_bytes = 0  # of the headers parsed so far (name, value, ": " and CRLF)
    _header_count = 0
    _head_refused = False

    def data_received(self, data: bytes) -> None:
        if self._head_open:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._head_open and self._head_bytes > self.max_head_bytes:
            self._refuse_head()

    def on_message_begin(self) -> None:
        self._header_bytes = self._header_count = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4
        if self._header_count > self.max_header_count or self._header_bytes > self.max_head_bytes:
            self._head_refused = True
            raise _HeadTooLarge()  # httptools stops; uvicorn calls send_400_response
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open, self._head_bytes = False, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_open = True  # what comes next is the next request's head
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._head_refused:
            return self._refuse_head()
        super().send_400_response(msg)

    def _refuse_head(self) -> None:
        self._head_refused = True
        if self.transport.is_closing():
            return
        logger.warning(
            "Request head over --max-request-header-size %d bytes or "
            "--max-request-header-count %d headers: 431, connection closed",
            self.max_head_bytes,
            self.max_header_count,
        )
        if self.cycle is None or self.cycle.response_complete:  # not inside a response
            self.transport.write(
                _head_too_large_response(self.max_head_bytes, self.max_header_count)
            )
        self.transport.close()


def _head_too_large_response(max_bytes: int, max_count: int) -> bytes:
    message = (
        f"The request headers exceed {max_bytes} bytes or {max_count} fields (the server's "
        "--max-request-header-size / --max-request-header-count)."
    )
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "RequestHeaderFieldsTooLargeError",
                "param": None,
                "code": 431,
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 431 Request Header Fields Too Large\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: ``serve_http`` owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class AccessLogPathFilter(logging.Filter):
    """--disable-access-log-for-endpoints: drops uvicorn's access log records of the
    ``paths`` (matched without the query string, with or without ``root_path``)."""

    def __init__(self, paths: frozenset[str], root_path: str | None = None) -> None:
        super().__init__()
        self.paths = paths
        self.root_path = root_path or ""

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's record: (client, method, path with query string, HTTP version, status).
        args = record.args
        if not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)):
            return True
        path = unquote(args[2].partition("?")[0])
        root = self.root_path
        if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
            path = path[len(root) :] or "/"
        return path not in self.paths


def uvicorn_config(app, args: FrontendArgs) -> uvicorn.Config:
    """uvicorn's settings from the server's flags."""
    return uvicorn.Config(
        app,
        log_level=args.uvicorn_log_level,
        log_config=uvicorn_log_config(args),  # --log-config-file's, else uvicorn's default
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
        access_log=not (args.disable_log_requests or args.disable_uvicorn_access_log),
        http=http_protocol(args),
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        # Only used by h11 (without httptools): its own bound on a request's head.
        h11_max_incomplete_event_size=args.max_request_header_size,
    )


@contextlib.contextmanager
def access_log_filtered(args: FrontendArgs) -> Iterator[None]:
    """uvicorn's access logger without --disable-access-log-for-endpoints's paths, while
    the server runs (after uvicorn configured logging: its config keeps the filter)."""
    paths = args.access_log_excluded_paths()
    if not paths:
        yield
        return
    access = logging.getLogger("uvicorn.access")
    log_filter = AccessLogPathFilter(paths, args.root_path)
    access.addFilter(log_filter)
    try:
        yield
    finally:
        access.removeFilter(log_filter)


async def serve_http(
    app, sock: socket.socket, engine: AsyncLLM, args: FrontendArgs, state: ServerState
) -> int:
    """Serve ``app`` on ``sock`` until a signal or the engine's death; the exit status."""
    server = _Server(uvicorn_config(app, args))
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
        with access_log_filtered(args):
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
    reason = engine.client.dead_reason or engine.client.exit_description
    if args.keep_alive_on_engine_death:
        logger.error("The engine core died (%s); serving 503/500 as asked", reason)
        return
    logger.error("The engine core died (%s): the API server exits", reason)
    state.exit_code = 1
    state.draining = state.closing = True
    server.should_exit = True
