"""The engine core in its own process, talking to the front end over pyzmq.

The wire contract (sockets, message types, payloads) is in ``vllm/v1/engine/__init__.py``.
This side receives ``EngineCoreRequestType`` messages on the input socket and sends
``EngineCoreOutputType`` messages on the output socket: READY once built, then OUTPUTS
after every step, REQUEST_ERROR for a rejected ADD or a request that failed inside a step
(the engine goes on), and FATAL (its last message) when building the engine, the engine
itself (steps failing in a row), or an incoming message fails. A message this process cannot
decode or does not know is a ``ProtocolError``: reported as FATAL, never skipped.

As in vLLM, a thread receives and unpickles inputs while the main thread steps the engine,
so a request's receipt time is when it reached this process, not when the current step
ended. An idle engine blocks on the input queue until the next pin deadline instead of
spinning. A paused or sleeping engine does not step the requests it holds: it blocks the
same way, and publishes its stats once a wait (``IDLE_POLL_S``), so that front ends
waiting on those requests see it alive. A ``pause`` utility call is answered once the
pause is complete: at once, or, for mode "wait", after the step where the last running
request finished.

The engine never outlives its front end. The front end holds the write end of a *death
pipe* whose read end this process watches: when the front end shuts down, or dies by any
means (SIGKILL included), the kernel closes the write end and this process stops. A
SHUTDOWN message that could not be delivered still ends the engine that way, and an
engine stuck inside a step is ended ``VLLM_ENGINE_ORPHAN_GRACE_S`` later regardless.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import zmq

from vllm import envs
from vllm.config import VllmConfig
from vllm.utils.gc_utils import freeze_gc_heap, maybe_attach_gc_debug_callback
from vllm.v1.engine import (
    UTILITY_METHODS,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequestError,
    EngineCoreRequestType,
    ProtocolError,
    StampedOutputs,
    UtilityCall,
    UtilityResult,
    decode_message,
    encode_message,
)

logger = logging.getLogger(__name__)

IDLE_POLL_S = 1.0  # the longest an idle engine blocks on its inbox

EngineFactory = Callable[[VllmConfig], Any]


class FrontEndGone:
    """Inbox item: the death pipe closed, the front end is gone."""


class Wake:
    """Inbox item: a thread of the engine has news for the loop (a KV connector's fetch is
    back); the loop then asks ``next_wakeup`` again."""


# A decoded input with its receipt time, the error that replaced an invalid one, the
# death pipe's news, or a wake-up.
InboxItem = tuple[EngineCoreRequestType, Any, float] | ProtocolError | FrontEndGone | Wake


def _default_factory(vllm_config: VllmConfig):
    from vllm.v1.engine.core import EngineCore

    return EngineCore(vllm_config)


def _as_list(addr: str | Sequence[str]) -> list[str]:
    return [addr] if isinstance(addr, str) else list(addr)


class EngineCoreProc:
    """Runs an ``EngineCore`` (or anything with its interface) behind two ZMQ sockets.

    ``engine_factory`` builds the engine from the config; tests pass a fake. The clock of
    ``next_wakeup`` deadlines must be ``time.monotonic`` (the core's default clock).
    ``death_pipe`` is the read end of the front end's death pipe (see the module
    docstring); it is watched from before the engine is built, since loading a model can
    take minutes.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        input_addr: str | Sequence[str],
        output_addr: str | Sequence[str],
        engine_factory: EngineFactory | None = None,
        death_pipe: Connection | None = None,
        freeze_gc: bool = False,
    ) -> None:
        """One input and one output address per front end (``--api-server-count``; the
        i-th pair is front end i's). ``freeze_gc``: once the engine is built, freeze the
        process's heap out of garbage collections before READY (``run_engine_core``: the
        process is the engine's; vllm/utils/gc_utils.py)."""
        self.ctx = zmq.Context()
        self.outputs: list[zmq.Socket] = []
        for addr in _as_list(output_addr):
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(addr)
            self.outputs.append(sock)
        self.input_addrs = _as_list(input_addr)
        if len(self.input_addrs) != len(self.outputs):
            raise ValueError(
                f"{len(self.input_addrs)} input and {len(self.outputs)} output addresses"
            )
        # Request id -> the index of the front end that sent it, with several front ends
        # (from its ADD until its last output, error or abort).
        self._owners: dict[str, int] = {}
        self.inbox: queue.SimpleQueue[InboxItem] = queue.SimpleQueue()
        self._stopped = threading.Event()  # set once the loop has ended and cleaned up
        if death_pipe is not None:
            threading.Thread(
                target=self._watch_front_end,
                args=(death_pipe,),
                name="EngineCoreDeathPipe",
                daemon=True,
            ).start()
        self._arrivals: dict[str, float] = {}  # received since the last outputs message
        self._pending_pauses: list[UtilityCall] = []  # answered once the engine drained
        try:
            self.engine = (engine_factory or _default_factory)(vllm_config)
        except Exception:
            self._send(EngineCoreOutputType.FATAL, traceback.format_exc())
            self._close()
            self._stopped.set()
            raise
        connector = getattr(self.engine, "kv_connector", None)
        if connector is not None:  # its threads wake the loop when blocks arrive
            connector.notify = lambda: self.inbox.put(Wake())
        if freeze_gc:  # for the process's life: its exit ends the hold
            freeze_gc_heap("engine core")
        ready = EngineCoreReady(num_gpu_blocks=self.engine.num_gpu_blocks, pid=os.getpid())
        self._send(EngineCoreOutputType.READY, ready)
        self.running = True

    def _send(
        self, msg_type: EngineCoreOutputType, payload: Any, client: int | None = None
    ) -> None:
        """To front end ``client``; None: to every front end."""
        frames = encode_message(msg_type, payload)
        for sock in self.outputs if client is None else (self.outputs[client],):
            sock.send_multipart(frames)

    def _watch_front_end(self, death_pipe: Connection) -> None:
        """Thread: wait for the death pipe's EOF, stop the loop, end the process if stuck."""
        try:
            while True:
                death_pipe.recv_bytes()  # the front end never writes; only EOF matters
        except (EOFError, OSError):
            pass
        logger.warning("the front end closed its death pipe; engine core exits")
        self.inbox.put(FrontEndGone())
        grace_s = envs.VLLM_ENGINE_ORPHAN_GRACE_S
        if not self._stopped.wait(grace_s):
            logger.error("engine core still running %.0f s after its front end left", grace_s)
            os._exit(1)

    def _input_loop(self) -> None:
        """Thread: socket -> inbox, stamping each message's receipt time."""
        sock = self.ctx.socket(zmq.PULL)
        for addr in self.input_addrs:  # fair-queued across front ends
            sock.connect(addr)
        try:
            while True:
                frames = sock.recv_multipart()
                received = time.monotonic()
                try:
                    msg_type, payload = decode_message(EngineCoreRequestType, frames)
                except ProtocolError as e:
                    self.inbox.put(e)  # raised by the main thread, in order
                    continue
                self.inbox.put((msg_type, payload, received))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def _handle(self, item: InboxItem) -> None:
        """Dispatch one input by type; ``ProtocolError`` ends the loop (reported as FATAL)."""
        if isinstance(item, ProtocolError):
            raise item
        if isinstance(item, FrontEndGone):
            self.running = False
            return
        if isinstance(item, Wake):
            return
        msg_type, payload, received = item
        match msg_type:
            case EngineCoreRequestType.ADD:
                client = payload.client_index
                if not 0 <= client < len(self.outputs):
                    raise ProtocolError(f"ADD from front end {client} of {len(self.outputs)}")
                try:
                    self.engine.add_request(payload)
                    self._arrivals[payload.request_id] = received
                    if len(self.outputs) > 1:
                        self._owners[payload.request_id] = client
                except ValueError as e:
                    error = EngineCoreRequestError(payload.request_id, str(e))
                    self._send(EngineCoreOutputType.REQUEST_ERROR, error, client)
            case EngineCoreRequestType.ABORT | EngineCoreRequestType.STOP:
                if msg_type is EngineCoreRequestType.ABORT:
                    self.engine.abort_requests(payload)
                else:
                    self.engine.stop_requests(payload)
                for request_id in payload:  # their front end has forgotten them
                    self._owners.pop(request_id, None)
            case EngineCoreRequestType.SHUTDOWN:
                self.running = False
            case EngineCoreRequestType.UTILITY:
                self._utility(payload)
            case _:  # a type added to the enum but not handled here
                raise ProtocolError(f"no handler for {msg_type.name}")

    def _utility(self, call: UtilityCall) -> None:
        """Run a utility method between steps and send its result to its caller; a
        method that raises answers with the error (the engine goes on)."""
        if not 0 <= call.client_index < len(self.outputs):
            raise ProtocolError(f"UTILITY from front end {call.client_index}")
        if call.method not in UTILITY_METHODS:
            raise ProtocolError(f"UTILITY method {call.method!r} is not one of the engine's")
        reply = UtilityResult(call.call_id)
        try:
            reply.result = getattr(self.engine, call.method)(*call.args)
            if call.method in ("sleep", "pause"):  # the aborted requests end before it returns
                self._send_outputs(reply.result)
                reply.result = None
        except Exception as e:
            logger.warning("utility %s failed: %s", call.method, e, exc_info=True)
            reply.error = f"{type(e).__name__}: {e}"
        if call.method == "pause" and reply.error is None:
            self._pending_pauses.append(call)
        else:
            self._send(EngineCoreOutputType.UTILITY_RESULT, reply, call.client_index)
        self._answer_pauses()

    def _answer_pauses(self) -> None:
        """Answer the pending ``pause`` calls once the pause is complete (the engine's
        ``pause_drained``), clearing the prefix cache for those that ask; a ``resume``
        that came first answers them with an error."""
        if not self._pending_pauses:
            return
        paused = self.engine.is_paused()
        if paused and not self.engine.pause_drained():
            return
        calls, self._pending_pauses = self._pending_pauses, []
        for call in calls:
            reply = UtilityResult(call.call_id)
            if not paused:
                reply.error = "ValueError: generation was resumed before the pause completed"
            else:
                try:
                    self.engine.finish_pause(*call.args[1:2])  # its clear_cache
                except Exception as e:
                    logger.warning("pause failed: %s", e, exc_info=True)
                    reply.error = f"{type(e).__name__}: {e}"
            self._send(EngineCoreOutputType.UTILITY_RESULT, reply, call.client_index)

    def _wait_s(self) -> float:
        """How long the loop may block for input: 0 with work, else until a deadline."""
        if self._has_work():
            return 0.0
        wake = self.engine.next_wakeup()
        wait = IDLE_POLL_S if wake is None else min(IDLE_POLL_S, wake - time.monotonic())
        return max(wait, 0.0)

    def _has_work(self) -> bool:
        """Requests to step; none while the engine sleeps (they wait for wake_up), only
        the running ones while it is paused (``EngineCore.has_work``)."""
        has_work = getattr(self.engine, "has_work", None)  # (tests' engines lack it)
        return self.engine.has_unfinished_requests() if has_work is None else has_work()

    def _holds_unstepped(self) -> bool:
        """Requests the engine holds but does not step (paused, asleep)."""
        return self.engine.has_unfinished_requests() and not self._has_work()

    def _drain_inputs(self, wait_s: float) -> bool:
        """Handle every queued message (waiting up to ``wait_s`` for the first)."""
        try:
            item = self.inbox.get(timeout=wait_s) if wait_s > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._handle(item)
            if not self.running:
                return True
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return True

    def _send_outputs(self, outputs: EngineCoreOutputs) -> None:
        # Requests that failed in the step first: the front end fails their streams.
        errors, outputs.errors = outputs.errors, []
        arrivals, self._arrivals = self._arrivals, {}
        if len(self.outputs) > 1:
            self._send_split(outputs, errors, arrivals)
            return
        for error in errors:
            self._send(EngineCoreOutputType.REQUEST_ERROR, error)
        self._send(
            EngineCoreOutputType.OUTPUTS, StampedOutputs(outputs, time.monotonic(), arrivals)
        )

    def _send_split(
        self,
        outputs: EngineCoreOutputs,
        errors: list[EngineCoreRequestError],
        arrivals: dict[str, float],
    ) -> None:
        """One step's outputs, errors and arrivals, each to the front end of its request;
        the scheduler stats to all (each front end's load and gauges read them). An
        output of a request no front end owns any more (aborted during the step) is
        dropped."""
        owners = self._owners
        split_arrivals: list[dict[str, float]] = [{} for _ in self.outputs]
        for request_id, received in arrivals.items():  # before a finish forgets the owner
            client = owners.get(request_id)
            if client is not None:
                split_arrivals[client][request_id] = received
        for error in errors:
            client = owners.pop(error.request_id, None)
            if client is not None:
                self._send(EngineCoreOutputType.REQUEST_ERROR, error, client)
        split = [EngineCoreOutputs(scheduler_stats=outputs.scheduler_stats) for _ in self.outputs]
        for out in outputs.outputs:
            if out.finished:
                client = owners.pop(out.request_id, None)
            else:
                client = owners.get(out.request_id)
            if client is not None:
                split[client].outputs.append(out)
        sent_at = time.monotonic()
        for client, part in enumerate(split):
            if part.outputs or split_arrivals[client] or part.scheduler_stats is not None:
                stamped = StampedOutputs(part, sent_at, split_arrivals[client])
                self._send(EngineCoreOutputType.OUTPUTS, stamped, client)

    def run(self) -> None:
        """Drain inputs, step while there is work, sleep otherwise."""
        threading.Thread(target=self._input_loop, name="EngineCoreInput", daemon=True).start()
        try:
            while self.running:
                handled = self._drain_inputs(self._wait_s())
                if not self.running:
                    break
                wake = self.engine.next_wakeup()
                pin_due = wake is not None and wake <= time.monotonic()
                if self._has_work() or pin_due:
                    self._send_outputs(self.engine.step())
                elif handled or self._holds_unstepped():
                    # An abort left the engine idle: publish the freed blocks now, since no
                    # step will carry fresh stats until the next request. Paused or asleep
                    # with requests: a sign of life for their front ends (once a wait).
                    stats = self.engine.make_stats()
                    self._send_outputs(EngineCoreOutputs(scheduler_stats=stats))
                self._answer_pauses()
        except Exception:
            # The front end fails its requests.
            self._send(EngineCoreOutputType.FATAL, traceback.format_exc())
            raise
        finally:
            self.engine.shutdown()
            self._close()
            self._stopped.set()

    def _close(self) -> None:
        for sock in self.outputs:
            sock.close(linger=1000)
        self.ctx.term()  # ends the input thread's recv (ContextTerminated)


def lower_cpu_priority() -> None:
    """On CPU, give the engine a lower scheduling priority than the API server.

    The engine's torch threads can use every core for a whole step, while the API server
    needs a core only for a fraction of a millisecond per request, event or response. At
    equal priority that work waits behind the engine's timeslices (the serving overhead
    of simultaneous requests tripled); a nice engine still gets all the CPU the server
    does not use. ``VLLM_CPU_ENGINE_NICE`` (default 10; 0 disables) is the increment.
    Called before torch starts its threads: they inherit it.
    """
    import torch

    if torch.cuda.is_available():
        return
    increment = envs.VLLM_CPU_ENGINE_NICE
    if increment > 0:
        os.nice(increment)


def run_engine_core(
    vllm_config: VllmConfig,
    input_addr: str | Sequence[str],
    output_addr: str | Sequence[str],
    log_level: int = logging.INFO,
    engine_factory: EngineFactory | None = None,
    death_pipe: Connection | None = None,
    keepalive: Connection | None = None,
) -> None:
    """Process entry point (spawn). ``keepalive``: a pipe end this process holds and never
    writes, so that its peers (API servers that did not start it) see EOF when it exits."""
    rank = os.environ.get("VLLM_DP_RANK")  # a data-parallel rank's engine (dp_client.py)
    name = "engine" if rank is None else f"engine {rank}"
    logging.basicConfig(
        level=log_level, format=f"%(levelname)s %(asctime)s [{name}] %(name)s: %(message)s"
    )
    # The front end owns Ctrl-C and SIGTERM (it drains running requests, then tells the
    # engine to stop); a signal sent to the whole process group must not cut the drain.
    # The engine exits when its front end goes away (the death pipe), however it went.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lower_cpu_priority()
    maybe_attach_gc_debug_callback()
    try:
        EngineCoreProc(
            vllm_config, input_addr, output_addr, engine_factory, death_pipe, freeze_gc=True
        ).run()
    except Exception:
        logger.exception("engine core failed")
        sys.exit(1)  # logged once; multiprocessing would print the traceback again
    finally:
        if keepalive is not None:
            keepalive.close()
