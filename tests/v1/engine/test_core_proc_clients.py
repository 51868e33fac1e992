"""One engine core, several front ends (``vllm serve --api-server-count``).

The proc runs in a thread over real ZMQ sockets with the fake engine of
``test_core_proc``; the linked-client tests spawn a real engine process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest
import zmq

from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine import (
    EngineCoreOutputType,
    EngineCoreRequestType,
    ProtocolError,
    decode_message,
    encode_message,
)
from vllm.v1.engine.core_client import (
    AsyncMPClient,
    EngineDeadError,
    EngineLink,
    start_engine_process,
)
from vllm.v1.engine.core_proc import EngineCoreProc

from .test_core_proc import (  # noqa: F401  (collect_garbage: an autouse fixture)
    POISON_TOKEN,
    collect_garbage,
    fake_engine_factory,
    request,
)

NUM_CLIENTS = 2


@pytest.fixture(scope="module")
def config():
    return EngineArgs(num_gpu_blocks_override=32).create_engine_config(2048)


class Clients:
    """Front ends 0..n-1's sockets, and one proc serving them all in a thread."""

    def __init__(self, config, tmp_path, n: int = NUM_CLIENTS) -> None:
        self.ctx = zmq.Context()
        self.inputs, self.outputs = [], []
        ins = [f"ipc://{tmp_path}/in-{i}" for i in range(n)]
        outs = [f"ipc://{tmp_path}/out-{i}" for i in range(n)]
        for i in range(n):
            push = self.ctx.socket(zmq.PUSH)
            push.bind(ins[i])
            pull = self.ctx.socket(zmq.PULL)
            pull.bind(outs[i])
            self.inputs.append(push)
            self.outputs.append(pull)
        self.proc = EngineCoreProc(config, ins, outs, fake_engine_factory)
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.proc.run()
        except Exception as e:
            self.error = e

    def add(self, client: int, request_id: str, max_tokens: int, prompt=None) -> None:
        r = request(request_id, max_tokens, prompt)
        r.client_index = client
        self.inputs[client].send_multipart(encode_message(EngineCoreRequestType.ADD, r))

    def recv(self, client: int, timeout_s: float = 5.0):
        if not self.outputs[client].poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no message for front end {client}")
        return decode_message(EngineCoreOutputType, self.outputs[client].recv_multipart())

    def quiet(self, client: int, wait_s: float = 0.3) -> bool:
        return not self.outputs[client].poll(int(wait_s * 1000))

    def until_finished(self, client: int, request_id: str) -> list:
        """Every message to ``client`` up to its request's finished output."""
        messages = []
        while True:
            msg_type, payload = self.recv(client)
            messages.append((msg_type, payload))
            if msg_type is EngineCoreOutputType.OUTPUTS and any(
                o.request_id == request_id and o.finished for o in payload.outputs.outputs
            ):
                return messages

    def close(self) -> None:
        if self.thread.is_alive():
            self.inputs[0].send_multipart(encode_message(EngineCoreRequestType.SHUTDOWN, None))
            self.thread.join(5)
        for sock in (*self.inputs, *self.outputs):
            sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def clients(config, tmp_path):
    c = Clients(config, tmp_path)
    for i in range(NUM_CLIENTS):
        assert c.recv(i)[0] is EngineCoreOutputType.READY  # READY to every front end
    c.thread.start()
    yield c
    c.close()


def _ids(messages) -> set[str]:
    return {
        o.request_id
        for t, p in messages
        if t is EngineCoreOutputType.OUTPUTS
        for o in p.outputs.outputs
    }


def test_each_front_end_gets_its_own_requests_outputs_and_every_steps_stats(clients):
    clients.add(0, "a", max_tokens=3)
    clients.add(1, "b", max_tokens=5)
    to_0 = clients.until_finished(0, "a")
    to_1 = clients.until_finished(1, "b")
    assert _ids(to_0) == {"a"} and _ids(to_1) == {"b"}
    tokens = sum(
        len(o.new_token_ids) for _, p in to_1 for o in p.outputs.outputs if o.request_id == "b"
    )
    assert tokens == 5
    # Each request's arrival went to its own front end, once.
    assert [r for _, p in to_0 for r in p.arrivals] == ["a"]
    assert [r for _, p in to_1 for r in p.arrivals] == ["b"]
    # Front end 0 kept getting the stats of the steps that served only "b".
    stats = [p.outputs.scheduler_stats for t, p in to_1]
    assert all(s is not None for s in stats)
    later = []
    while not clients.quiet(0, 0.5):
        later.append(clients.recv(0))
    assert later and all(t is EngineCoreOutputType.OUTPUTS for t, _ in later)
    assert all(not p.outputs.outputs and p.outputs.scheduler_stats for _, p in later)
    assert not clients.proc._owners  # finished requests are forgotten


def test_a_request_error_goes_to_the_front_end_that_sent_it(clients):
    clients.add(1, "empty", max_tokens=2, prompt=[])  # rejected at ADD
    msg_type, error = clients.recv(1)
    assert msg_type is EngineCoreOutputType.REQUEST_ERROR and error.request_id == "empty"
    clients.add(1, "bad", max_tokens=2, prompt=[POISON_TOKEN, 1])  # fails in its step
    messages = []
    while not any(t is EngineCoreOutputType.REQUEST_ERROR for t, _ in messages):
        messages.append(clients.recv(1))
    assert messages[-1][1].request_id == "bad" and messages[-1][1].internal
    while not clients.quiet(0, 0.3):  # front end 0 saw the step's stats, no error
        assert clients.recv(0)[0] is EngineCoreOutputType.OUTPUTS
    assert not clients.proc._owners


@pytest.mark.parametrize("how", [EngineCoreRequestType.ABORT, EngineCoreRequestType.STOP])
def test_an_aborted_or_stopped_request_is_forgotten_and_sends_nothing_more(clients, how):
    clients.add(0, "long", max_tokens=10_000)
    clients.recv(0)
    clients.inputs[0].send_multipart(encode_message(how, ["long"]))
    deadline = time.monotonic() + 5
    while clients.proc._owners:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    while not clients.quiet(0, 0.3):
        clients.recv(0)  # outputs of steps before the abort
    assert not clients.proc.engine.requests


def test_a_front_end_index_out_of_range_is_a_protocol_error(clients):
    clients.add(0, "x", max_tokens=1)
    r = request("y", 1)
    r.client_index = NUM_CLIENTS
    clients.inputs[1].send_multipart(encode_message(EngineCoreRequestType.ADD, r))
    clients.thread.join(5)
    assert isinstance(clients.error, ProtocolError)
    for i in range(NUM_CLIENTS):  # FATAL reaches every front end
        while True:
            msg_type, payload = clients.recv(i)
            if msg_type is EngineCoreOutputType.FATAL:
                assert "front end 2 of 2" in payload
                break


def test_mismatched_address_lists_are_refused(config, tmp_path):
    with pytest.raises(ValueError, match="2 input and 1 output"):
        EngineCoreProc(config, ["ipc://a", "ipc://b"], [f"ipc://{tmp_path}/o"], fake_engine_factory)


def test_linked_clients_share_one_engine_and_see_its_death(config, tmp_path):
    spawn = multiprocessing.get_context("spawn")
    alive_reader, alive_writer = spawn.Pipe(duplex=False)
    ins = [f"ipc://{tmp_path}/in-{i}" for i in range(NUM_CLIENTS)]
    outs = [f"ipc://{tmp_path}/out-{i}" for i in range(NUM_CLIENTS)]

    async def scenario(proc) -> None:
        links = [EngineLink(ins[i], outs[i], i, alive_reader) for i in range(NUM_CLIENTS)]
        clients = [AsyncMPClient(config, link=link) for link in links]
        alive_writer.close()  # the engine holds the only write end now
        try:
            infos = [await c.wait_ready() for c in clients]
            assert {i.pid for i in infos} == {proc.pid}
            for i, c in enumerate(clients):
                r = request(f"r{i}", max_tokens=2)
                r.client_index = c.client_index
                await c.send(EngineCoreRequestType.ADD, r)
            for i, c in enumerate(clients):
                seen = set()
                while f"r{i}" not in seen:
                    msg_type, payload = await c.recv(timeout_s=5)
                    seen |= {o.request_id for o in payload.outputs.outputs}
                assert seen == {f"r{i}"}
            clients[1].shutdown()  # one API server leaving does not stop the engine
            await asyncio.sleep(0.3)
            assert proc.is_alive() and clients[0].is_alive
            proc.kill()
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="its process exited"):
                while True:
                    await clients[0].recv(timeout_s=0.5)
            assert time.monotonic() - start < 3 and not clients[0].is_alive
        finally:
            clients[0].shutdown()

    proc, death_writer = start_engine_process(
        config, ins, outs, fake_engine_factory, keepalive=alive_writer
    )
    try:
        asyncio.run(scenario(proc))
    finally:
        death_writer.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        alive_reader.close()
