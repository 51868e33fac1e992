"""EngineCoreProc over real ZMQ sockets, with a fake engine (no model).

The proc runs in a thread for the loop tests; the client test spawns a real process.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import (
    PAYLOAD_TYPES,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreOutputType,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreRequestError,
    EngineCoreRequestType,
    FinishReason,
    ProtocolError,
    StampedOutputs,
    decode_message,
    encode_message,
)
from vllm.v1.engine.core_client import (
    AsyncMPClient,
    EngineDeadError,
    EngineStartupError,
    engine_process_env,
)
from vllm.v1.engine.core_proc import EngineCoreProc
from vllm.v1.metrics.stats import SchedulerStats


class _FakeScheduler:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.engine.requests))


POISON_TOKEN = 666
# A request whose prompt starts with it never finishes by itself: it runs until aborted
# (however fast the fake engine steps, a slow test still finds it running).
ENDLESS_TOKEN = 777


class FakeEngine:
    """One token (id 7) per request per step until max_tokens; records the steps. A request
    whose prompt starts with POISON_TOKEN fails in its first step; one whose prompt starts
    with ENDLESS_TOKEN runs until aborted."""

    num_gpu_blocks = 32

    def __init__(self, vllm_config=None) -> None:
        override = vllm_config.cache_config.num_gpu_blocks_override if vllm_config else None
        self.num_gpu_blocks = override or FakeEngine.num_gpu_blocks  # the pool it reports
        self.requests: dict[str, list[int]] = {}  # id -> [generated, max_tokens]
        self.step_times: list[float] = []
        self.wakeup: float | None = None
        self.scheduler = _FakeScheduler(self)
        self.shut_down = False
        self.poisoned: set[str] = set()  # requests whose prompt starts with POISON_TOKEN

    def add_request(self, request: EngineCoreRequest) -> None:
        if not request.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        max_tokens = request.sampling_params.max_tokens
        if request.prompt_token_ids[0] == ENDLESS_TOKEN:
            max_tokens = float("inf")
        self.requests[request.request_id] = [0, max_tokens]
        if request.prompt_token_ids[0] == POISON_TOKEN:
            self.poisoned.add(request.request_id)

    def abort_requests(self, ids: list[str]) -> None:
        for request_id in ids:
            self.requests.pop(request_id, None)

    stop_requests = abort_requests  # finished without an output, as EngineCore does

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def next_wakeup(self) -> float | None:
        return self.wakeup

    def step(self) -> EngineCoreOutputs:
        self.step_times.append(time.monotonic())
        if "explode" in self.requests:
            raise RuntimeError("step exploded")
        if self.wakeup is not None and self.wakeup <= time.monotonic():
            self.wakeup = None  # the pin expired
        outputs, errors = [], []
        for request_id in [r for r in self.requests if r in self.poisoned]:
            # Fails inside its first step, as EngineCore reports it (issue 16).
            del self.requests[request_id]
            errors.append(EngineCoreRequestError(request_id, "poisoned", internal=True))
        for request_id, state in list(self.requests.items()):
            state[0] += 1
            done = state[0] >= state[1]
            outputs.append(
                EngineCoreOutput(
                    request_id, [7], finish_reason=FinishReason.LENGTH if done else None
                )
            )
            if done:
                del self.requests[request_id]
        return EngineCoreOutputs(outputs, self.make_stats(), errors=errors)

    def make_stats(self):
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:  # a utility method: refused while requests run
        return not self.requests

    def profile(self, start: bool) -> None:  # a utility method that raises
        raise ValueError("no profiler here")

    def shutdown(self) -> None:
        self.shut_down = True


def fake_engine_factory(vllm_config) -> FakeEngine:
    return FakeEngine(vllm_config)


def broken_engine_factory(vllm_config) -> FakeEngine:
    raise RuntimeError("no model here")


def stuck_engine_factory(vllm_config) -> FakeEngine:
    time.sleep(60)  # never ready: the test kills the process


UNKNOWN_TYPE = [b"\x7f", pickle.dumps(None)]
# Frames that break the contract, for the engine's input socket.
INVALID_INPUTS = {
    "unknown type": UNKNOWN_TYPE,
    "one frame": [EngineCoreRequestType.SHUTDOWN.value],
    "undecodable": [EngineCoreRequestType.ABORT.value, b"not a pickle"],
    "mistyped": [EngineCoreRequestType.ADD.value, pickle.dumps(["a"])],
}


def inject(addr: str, frames: list[bytes]) -> None:
    """Send ``frames`` to the PULL socket bound at ``addr``, as a broken peer would."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(addr)
    sock.send_multipart(frames)
    sock.close(linger=2000)
    ctx.term()


@pytest.fixture(autouse=True)
def collect_garbage():
    # Sockets and loops left in reference cycles would otherwise be finalized during some
    # later compile(), which CPython 3.11.7 reports as "AST constructor recursion depth
    # mismatch".
    yield
    gc.collect()


@pytest.fixture(scope="module")
def config():
    return EngineArgs(num_gpu_blocks_override=32).create_engine_config(2048)


def request(request_id: str, max_tokens: int, prompt: list[int] | None = None):
    params = SamplingParams(max_tokens=max_tokens)
    return EngineCoreRequest(request_id, [1, 2, 3] if prompt is None else prompt, params)


class Harness:
    """The front end's sockets, and the proc running in a thread."""

    def __init__(self, config, tmp_path, factory=fake_engine_factory, death_pipe=None) -> None:
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PUSH)
        self.input.bind(f"ipc://{tmp_path}/in")
        self.output = self.ctx.socket(zmq.PULL)
        self.output.bind(f"ipc://{tmp_path}/out")
        self.proc = EngineCoreProc(
            config, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", factory, death_pipe
        )
        self.engine: FakeEngine = self.proc.engine
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.proc.run()
        except Exception as e:  # what the process entry point would log
            self.error = e

    def send(self, msg_type: EngineCoreRequestType, payload) -> None:
        self.input.send_multipart(encode_message(msg_type, payload))

    def recv(self, timeout_s: float = 5.0):
        if not self.output.poll(int(timeout_s * 1000)):
            raise TimeoutError("no message from the engine")
        return decode_message(EngineCoreOutputType, self.output.recv_multipart())

    def recv_outputs(self) -> StampedOutputs:
        msg_type, payload = self.recv()
        assert msg_type is EngineCoreOutputType.OUTPUTS
        return payload

    def outputs_until_finished(self, request_id: str) -> list[StampedOutputs]:
        messages = []
        while True:
            messages.append(self.recv_outputs())
            if any(o.request_id == request_id and o.finished for o in messages[-1].outputs.outputs):
                return messages

    def close(self) -> None:
        if self.thread.is_alive():
            self.send(EngineCoreRequestType.SHUTDOWN, None)
            self.thread.join(5)
        self.input.close(linger=0)
        self.output.close(linger=0)
        self.ctx.term()


@pytest.fixture
def harness(config, tmp_path):
    h = Harness(config, tmp_path)
    assert h.recv() == (EngineCoreOutputType.READY, EngineCoreReady(32, os.getpid()))
    h.thread.start()
    yield h
    h.close()


def test_request_streams_outputs_with_engine_timestamps(harness):
    harness.send(EngineCoreRequestType.ADD, request("a", max_tokens=3))
    messages = harness.outputs_until_finished("a")
    tokens = [t for m in messages for o in m.outputs.outputs for t in o.new_token_ids]
    assert tokens == [7, 7, 7]
    arrivals = messages[0].arrivals
    assert set(arrivals) == {"a"} and arrivals["a"] <= messages[0].sent_at <= time.monotonic()
    assert all(not m.arrivals for m in messages[1:])  # an arrival is reported once


def test_idle_engine_sleeps_instead_of_spinning(harness):
    harness.send(EngineCoreRequestType.ADD, request("a", max_tokens=2))
    harness.outputs_until_finished("a")
    steps = len(harness.engine.step_times)
    time.sleep(0.3)
    assert len(harness.engine.step_times) == steps


def test_idle_engine_wakes_at_the_pin_deadline(harness):
    harness.send(EngineCoreRequestType.ADD, request("a", max_tokens=1))
    harness.outputs_until_finished("a")
    deadline = time.monotonic() + 0.25
    harness.engine.wakeup = deadline  # a pin expiring (set between steps: engine idle)
    harness.send(EngineCoreRequestType.ABORT, [])  # wake the loop: it re-reads next_wakeup
    harness.recv()  # the idle-stats message of that abort
    msg_type, _ = harness.recv(timeout_s=2.0)
    assert msg_type is EngineCoreOutputType.OUTPUTS
    assert harness.engine.step_times[-1] >= deadline
    time.sleep(0.2)
    assert harness.engine.step_times[-1] < deadline + 0.15  # one step, then asleep again


def test_abort_publishes_fresh_stats_while_idle(harness):
    harness.send(EngineCoreRequestType.ADD, request("long", max_tokens=10_000))
    assert harness.recv_outputs().outputs.scheduler_stats.num_running_reqs == 1
    harness.send(EngineCoreRequestType.ABORT, ["long"])
    deadline = time.monotonic() + 5
    while True:  # steps already sent before the abort may come first
        outputs = harness.recv_outputs().outputs
        if outputs.scheduler_stats.num_running_reqs == 0:
            break
        assert time.monotonic() < deadline
    assert not outputs.outputs and not harness.engine.requests


def test_bad_request_reports_an_error_and_engine_goes_on(harness):
    harness.send(EngineCoreRequestType.ADD, request("bad", max_tokens=1, prompt=[]))
    error = EngineCoreRequestError("bad", "prompt_token_ids must not be empty")
    assert harness.recv() == (EngineCoreOutputType.REQUEST_ERROR, error)
    harness.send(EngineCoreRequestType.ADD, request("good", max_tokens=1))
    harness.outputs_until_finished("good")


def test_a_request_failed_in_a_step_is_a_request_error_and_the_engine_goes_on(harness):
    harness.send(EngineCoreRequestType.ADD, request("bad", max_tokens=2, prompt=[POISON_TOKEN]))
    error = EngineCoreRequestError("bad", "poisoned", internal=True)
    assert harness.recv() == (EngineCoreOutputType.REQUEST_ERROR, error)  # before the step's
    outputs = harness.recv_outputs().outputs
    assert outputs.errors == [] and outputs.outputs == []
    harness.send(EngineCoreRequestType.ADD, request("ok", max_tokens=2))
    harness.outputs_until_finished("ok")
    assert harness.thread.is_alive()


def test_a_failing_step_is_reported_as_fatal(harness):
    harness.send(EngineCoreRequestType.ADD, request("explode", max_tokens=1))
    msg_type, text = harness.recv()
    assert msg_type is EngineCoreOutputType.FATAL and "RuntimeError: step exploded" in text
    harness.thread.join(3)
    assert not harness.thread.is_alive() and harness.engine.shut_down
    assert isinstance(harness.error, RuntimeError)


def test_shutdown_stops_the_loop(harness):
    harness.send(EngineCoreRequestType.SHUTDOWN, None)
    harness.thread.join(3)
    assert not harness.thread.is_alive() and harness.engine.shut_down


def test_closing_the_death_pipe_stops_the_loop(config, tmp_path):
    reader, writer = multiprocessing.Pipe(duplex=False)
    h = Harness(config, tmp_path, death_pipe=reader)
    try:
        assert h.recv()[0] is EngineCoreOutputType.READY
        h.thread.start()
        h.send(EngineCoreRequestType.ADD, request("a", max_tokens=1))
        h.outputs_until_finished("a")
        writer.close()  # the front end is gone; no SHUTDOWN was sent
        h.thread.join(3)
        assert not h.thread.is_alive() and h.engine.shut_down and h.error is None
    finally:
        h.close()


def test_every_message_type_has_a_payload_type_and_round_trips():
    assert set(PAYLOAD_TYPES) == {*EngineCoreRequestType, *EngineCoreOutputType}
    frames = encode_message(EngineCoreRequestType.ABORT, ["a", "b"])
    assert frames[0] == b"\x01" and len(frames) == 2
    assert decode_message(EngineCoreRequestType, frames) == (
        EngineCoreRequestType.ABORT,
        ["a", "b"],
    )


def test_an_engine_output_round_trips_every_field():
    # EngineCoreOutput pickles as its constructor's positional arguments: every field,
    # in order, none left behind (a field added later included).
    import dataclasses

    from vllm.v1.outputs import TokenLogprobs

    values = {
        "request_id": "r-1",
        "new_token_ids": [5, 6],
        "new_logprobs": [TokenLogprobs(5, -0.5, 1, {5: -0.5})],
        "new_prompt_logprobs": [TokenLogprobs(2, -1.0, 3, {})],
        "finish_reason": FinishReason.STOP,
        "stop_reason": "###",
        "num_cached_tokens": 16,
        "queue_time_s": 0.25,
        "num_prompt_tokens": 9,
        "pooled": [0.5, -0.5],
        "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 5600},
    }
    assert set(values) == {f.name for f in dataclasses.fields(EngineCoreOutput)}
    out = EngineCoreOutput(**values)
    stamped = StampedOutputs(EngineCoreOutputs([out, EngineCoreOutput("r-2", [])]), 1.0, {})
    _, got = decode_message(
        EngineCoreOutputType, encode_message(EngineCoreOutputType.OUTPUTS, stamped)
    )
    assert got.outputs.outputs == [out, EngineCoreOutput("r-2", [])]


@pytest.mark.parametrize("frames", INVALID_INPUTS.values(), ids=INVALID_INPUTS.keys())
def test_decode_rejects_what_breaks_the_contract(frames):
    with pytest.raises(ProtocolError):
        decode_message(EngineCoreRequestType, frames)


def test_encode_rejects_a_mistyped_payload():
    with pytest.raises(ProtocolError, match="ADD carries EngineCoreRequest, not list"):
        encode_message(EngineCoreRequestType.ADD, ["a"])


@pytest.mark.parametrize("frames", INVALID_INPUTS.values(), ids=INVALID_INPUTS.keys())
def test_an_invalid_input_is_fatal_not_skipped(harness, frames):
    harness.send(EngineCoreRequestType.ADD, request("before", max_tokens=1))
    harness.outputs_until_finished("before")
    harness.input.send_multipart(frames)
    msg_type, text = harness.recv()
    assert msg_type is EngineCoreOutputType.FATAL and "ProtocolError" in text
    harness.thread.join(3)
    assert not harness.thread.is_alive() and harness.engine.shut_down
    assert isinstance(harness.error, ProtocolError)


def test_engine_construction_failure_is_reported(config, tmp_path):
    ctx = zmq.Context()
    out = ctx.socket(zmq.PULL)
    out.bind(f"ipc://{tmp_path}/out")
    with pytest.raises(RuntimeError, match="no model here"):
        EngineCoreProc(
            config, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", broken_engine_factory
        )
    msg_type, text = decode_message(EngineCoreOutputType, out.recv_multipart())
    assert msg_type is EngineCoreOutputType.FATAL and "no model here" in text
    out.close(linger=0)
    ctx.term()


def test_client_spawns_engine_and_detects_its_death(config):
    async def scenario() -> None:
        client = AsyncMPClient(config, engine_factory=fake_engine_factory)
        try:
            info = await client.wait_ready()
            assert info.pid == client.proc.pid != os.getpid()
            await client.send(EngineCoreRequestType.ADD, request("a", max_tokens=2))
            msg_type, payload = await client.recv(timeout_s=5)
            assert msg_type is EngineCoreOutputType.OUTPUTS and "a" in payload.arrivals
            client.proc.kill()
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="died"):
                while True:  # drain what was sent before the kill
                    await client.recv(timeout_s=0.5)
            assert time.monotonic() - start < 3 and not client.is_alive
            with pytest.raises(EngineDeadError):
                await client.send(EngineCoreRequestType.ADD, request("b", max_tokens=1))
        finally:
            client.shutdown()

    asyncio.run(scenario())


def test_client_reports_a_failed_start(config):
    async def scenario() -> None:
        client = AsyncMPClient(config, engine_factory=broken_engine_factory)
        try:
            with pytest.raises(EngineStartupError, match="no model here"):
                await client.wait_ready()
        finally:
            client.shutdown()

    asyncio.run(scenario())


def test_client_treats_an_unknown_message_as_engine_death(config):
    async def scenario() -> None:
        client = AsyncMPClient(config, engine_factory=fake_engine_factory)
        try:
            await client.wait_ready()
            inject(client.output_addr, UNKNOWN_TYPE)
            with pytest.raises(EngineDeadError, match="unknown EngineCoreOutputType"):
                await client.recv(timeout_s=5)
            assert not client.is_alive
        finally:
            client.shutdown()

    asyncio.run(scenario())


def test_client_fails_to_start_on_an_unknown_message(config):
    async def scenario() -> None:
        client = AsyncMPClient(config, engine_factory=stuck_engine_factory)
        try:
            inject(client.output_addr, UNKNOWN_TYPE)
            with pytest.raises(EngineStartupError, match="protocol error"):
                await client.wait_ready()
        finally:
            client.shutdown(timeout_s=0.5)
        assert not client.proc.is_alive()

    asyncio.run(scenario())


def test_an_engine_declared_dead_ends_itself(config, monkeypatch):
    # The engine is stuck building (it never reads a SHUTDOWN): declaring it dead closes
    # the death pipe, and it ends itself after its grace period, with no signal.
    monkeypatch.setenv("VLLM_ENGINE_ORPHAN_GRACE_S", "0.2")

    async def scenario() -> None:
        client = AsyncMPClient(config, engine_factory=stuck_engine_factory)
        try:
            await asyncio.sleep(0.5)  # let it start its watcher
            client.mark_dead("test")
            client.proc.join(10)
            assert client.proc.exitcode == 1  # its own os._exit(1), not a kill
        finally:
            client.shutdown(timeout_s=0.5)

    asyncio.run(scenario())


def test_shutdown_kills_an_engine_that_does_not_stop(config, monkeypatch):
    # SIGTERM is ignored by the engine and the grace is long: shutdown still returns with
    # the process gone, in about its timeout.
    monkeypatch.setenv("VLLM_ENGINE_ORPHAN_GRACE_S", "60")

    async def scenario() -> None:
        client = AsyncMPClient(config, engine_factory=stuck_engine_factory)
        await asyncio.sleep(0.5)
        start = time.monotonic()
        client.shutdown(timeout_s=0.5)
        assert not client.proc.is_alive() and client.proc.exitcode == -signal.SIGKILL
        assert time.monotonic() - start < 5

    asyncio.run(scenario())


FRONT_END = """
import asyncio, sys
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.core_client import AsyncMPClient
from tests.v1.engine.test_core_proc import fake_engine_factory

async def main():
    config = EngineArgs(num_gpu_blocks_override=32).create_engine_config(2048)
    client = AsyncMPClient(config, engine_factory=fake_engine_factory)
    info = await client.wait_ready()
    print(info.pid, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, unreaped
    except FileNotFoundError:
        return True


def test_engine_exits_when_its_front_end_is_killed():
    # SIGKILL gives the front end no chance to send SHUTDOWN: the kernel closes its end
    # of the death pipe, and the orphaned engine stops.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    front = subprocess.Popen(
        [sys.executable, "-c", FRONT_END], cwd=repo, stdout=subprocess.PIPE, text=True
    )
    engine_pid = None
    try:
        engine_pid = int(front.stdout.readline())
        assert not _gone(engine_pid)
        front.kill()
        front.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its front end"
            time.sleep(0.1)
    finally:
        front.kill()
        front.wait(10)
        front.stdout.close()
        if engine_pid is not None and not _gone(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)  # never leave it behind, pass or fail


def test_engine_process_env_shortens_the_openmp_spin_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert engine_process_env() == {"GOMP_SPINCOUNT": "10000"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert engine_process_env() == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    assert engine_process_env() == {}
