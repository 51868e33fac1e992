"""The engine core in its own process, talking to the front end over pyzmq.

Inputs (PULL): pickled ``("add", EngineCoreRequest)``, ``("abort", [ids])``,
``("shutdown", None)``. Outputs (PUSH): ``("ready", info)``, ``("outputs",
EngineCoreOutputs)``, ``("request_error", (request_id, message))``, ``("fatal", text)``.
An idle engine blocks on its input socket until the next pin deadline instead of spinning.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback

import zmq

from vllm.config import VllmConfig
from vllm.utils.clock import monotonic_clock
from vllm.v1.engine import EngineCoreOutputs

logger = logging.getLogger(__name__)

IDLE_POLL_S = 1.0  # an idle engine still wakes up this often to notice a dead parent


class EngineCoreProc:
    def __init__(self, vllm_config: VllmConfig, input_addr: str, output_addr: str) -> None:
        from vllm.v1.engine.core import EngineCore

        self.ctx = zmq.Context()
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(output_addr)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.parent = os.getppid()
        try:
            self.engine = EngineCore(vllm_config)
        except Exception:
            self._send("fatal", traceback.format_exc())
            raise
        self._send("ready", {"num_gpu_blocks": self.engine.num_gpu_blocks, "pid": os.getpid()})
        self.running = True

    def _send(self, kind: str, payload) -> None:
        self.output.send(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            try:
                self.engine.add_request(payload)
            except ValueError as e:
                self._send("request_error", (payload.request_id, str(e)))
        elif kind == "abort":
            self.engine.abort_requests(payload)
        elif kind == "shutdown":
            self.running = False

    def _poll_timeout_ms(self) -> int:
        if self.engine.has_work():
            return 0
        wake = self.engine.next_wakeup()
        wait = IDLE_POLL_S if wake is None else min(IDLE_POLL_S, wake - monotonic_clock())
        return max(int(wait * 1000), 0)

    def run(self) -> None:
        """Drain inputs, step while there is work, sleep otherwise."""
        poller = zmq.Poller()
        poller.register(self.input, zmq.POLLIN)
        while self.running:
            timeout = self._poll_timeout_ms()
            handled = False
            if poller.poll(timeout):
                while True:
                    try:
                        msg = self.input.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(*pickle.loads(msg))
                    handled = True
            if os.getppid() != self.parent:
                logger.error("front end died; engine core exits")
                break
            wake = self.engine.next_wakeup()
            if self.engine.has_work() or (wake is not None and wake <= monotonic_clock()):
                self._send("outputs", self.engine.step())
            elif handled:
                # An abort left the engine idle: publish the freed blocks now, since no
                # step will carry fresh stats until the next request.
                stats = self.engine.scheduler.make_stats()
                self._send("outputs", EngineCoreOutputs(scheduler_stats=stats))
        self.engine.shutdown()
        self.output.close(linger=1000)
        self.input.close(linger=0)
        self.ctx.term()


def run_engine_core(
    vllm_config: VllmConfig, input_addr: str, output_addr: str, log_level: int = logging.INFO
) -> None:
    """Process entry point (spawn)."""
    logging.basicConfig(
        level=log_level, format="%(levelname)s %(asctime)s [engine] %(name)s: %(message)s"
    )
    # The front end owns Ctrl-C; the engine stops when told (or when the parent dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        EngineCoreProc(vllm_config, input_addr, output_addr).run()
    except Exception:
        logger.exception("engine core failed")
        raise
