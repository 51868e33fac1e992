"""/v1/responses in the background (``background: true``): the event log and a cancel
across API servers sharing the store (no server), then end to end with the official
openai client on a tiny random model (``slow``): answered at once, polled, its events
replayed, cancelled; a client that leaves does not stop it, a shutdown does."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from types import SimpleNamespace

import openai
import pytest

from tests.entrypoints.test_generation_config import TOKENIZER_FILES
from tests.tiny_models import save_tiny_llama
from vllm.benchmarks.server import RemoteServer
from vllm.config import DEFAULT_MODEL
from vllm.entrypoints.openai import serving_responses
from vllm.entrypoints.openai.responses_background import EventLog, EventLogs
from vllm.entrypoints.openai.responses_store import SharedResponseStore, StoredResponse
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses, _Background
from vllm.model_executor.model_loader import resolve_model

MODEL = "tiny"
LONG = 3500  # output tokens: seconds of generation, time to cancel, leave or shut down
RUNNING, USAGE = "vllm:num_requests_running", "vllm:kv_cache_usage_perc"


# -- no server ----------------------------------------------------------------------------
def test_an_event_log_replays_then_follows_until_closed():
    async def main():
        log = EventLog()
        log.append("e0")
        log.append("e1")
        late = asyncio.ensure_future(_read(log.follow(1)))
        early = asyncio.ensure_future(_read(log.follow()))
        await asyncio.sleep(0)
        log.append("e2")
        await asyncio.sleep(0)
        log.close()
        assert await late == ["e1", "e2"] and await early == ["e0", "e1", "e2"]
        assert await _read(log.follow(3)) == []  # past the end of a closed log

    asyncio.run(main())


async def _read(events) -> list[str]:
    return [e async for e in events]


def test_finished_event_logs_are_bounded_running_ones_kept():
    logs = EventLogs(max_finished=1)
    for i in range(3):
        logs.new(f"r{i}")
    logs.finished("r0")
    logs.finished("r1")
    assert logs.get("r0") is None and logs.get("r1").closed and not logs.get("r2").closed


class _Stream:
    closed = False

    async def aclose(self) -> None:
        self.closed = True


def test_a_cancel_on_another_api_server_stops_the_run(tmp_path, monkeypatch):
    """--api-server-count N: the process that runs a background response sees the mark
    another one's cancel wrote into the shared store, and aborts its engine request."""
    monkeypatch.setattr(serving_responses, "CANCEL_POLL_S", 0.01)
    path = str(tmp_path / "responses.db")

    async def main():
        owner = OpenAIServingResponses(None, SharedResponseStore(path))
        other = OpenAIServingResponses(None, SharedResponseStore(path))
        body = {"id": "resp_1", "status": "in_progress", "background": True, "output": []}
        owner.store.put(StoredResponse(body, [], "job"))
        turn, stream = SimpleNamespace(cancelled=False, events=None), _Stream()
        task = asyncio.ensure_future(asyncio.sleep(60))
        owner.background["resp_1"] = _Background(turn, task, stream)
        watcher = asyncio.ensure_future(owner._watch_cancel("resp_1"))
        assert (await other.cancel("resp_1"))["status"] == "cancelled"
        await asyncio.wait_for(watcher, 5)
        assert task.cancelled() and stream.closed and turn.cancelled
        assert "resp_1" not in owner.background
        assert owner.store.get("resp_1").response["status"] == "cancelled"

    asyncio.run(main())


# -- end to end ---------------------------------------------------------------------------
def long_tiny_model(path) -> str:
    """A tiny random Llama (greedy: it never says EOS here) with room for LONG tokens."""
    path.mkdir(parents=True)
    save_tiny_llama(path, vocab_size=49152, max_position_embeddings=4096)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{resolve_model(DEFAULT_MODEL)}/{name}", path / name)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("background")
    srv = RemoteServer(
        "--model", long_tiny_model(out / "model"), "--served-model-name", MODEL,
        "--max-model-len", "4096", "--shutdown-timeout", "1",
        log_path=str(out / "server.log"),
    )  # fmt: skip
    srv.log_file = out / "server.log"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def create(client, max_output_tokens=8, **kw):
    return client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=max_output_tokens, temperature=0, **kw
    )


def poll(client, response_id: str, until=("completed", "incomplete", "failed", "cancelled")):
    deadline = time.monotonic() + 60
    while (resp := client.responses.retrieve(response_id)).status not in until:
        assert time.monotonic() < deadline, resp.status
        time.sleep(0.05)
    return resp


def running(server, client, response_id: str) -> None:
    """Wait until the response generates (in the engine, not only queued)."""
    poll(client, response_id, until=("in_progress",))
    deadline = time.monotonic() + 30
    while server.metrics()[RUNNING] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def no_request_left(server) -> None:
    assert server.wait_metric(RUNNING, 0.0) == 0.0
    assert server.wait_metric(USAGE, 0.0) == 0.0  # its KV blocks are back


@pytest.mark.slow
def test_answered_at_once_then_polled_to_the_foreground_output(client):
    resp = create(client, background=True)
    assert resp.status in ("queued", "in_progress") and resp.background is True
    assert resp.output == [] and resp.usage is None
    done = poll(client, resp.id)
    assert done.status == "incomplete" and done.background is True
    assert done.usage.output_tokens == 8
    foreground = create(client)
    assert foreground.background is False and foreground.output_text == done.output_text
    # A chain continues from a background response as from any other.
    second = create(client, previous_response_id=resp.id, background=True)
    assert poll(client, second.id).usage.input_tokens > done.usage.input_tokens


@pytest.mark.slow
def test_refusals(client):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, background=True, store=False)
    assert e.value.body["param"] == "background"
    foreground = create(client)
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI: only background ones
        client.responses.cancel(foreground.id)
    assert e.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as e:  # no events were kept
        client.responses.retrieve(foreground.id, stream=True)
    assert e.value.body["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


@pytest.mark.slow
def test_streamed_events_are_replayed_after_starting_after(client):
    events = list(create(client, background=True, stream=True, max_output_tokens=16))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[-1].type == "response.incomplete" and events[-1].response.background
    response_id = events[0].response.id
    replay = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in events[4:]]
    stored = client.responses.retrieve(response_id)
    assert stored.output_text == events[-1].response.output_text and stored.usage
    # A finished one cannot be cancelled: it comes back as it is (OpenAI's idempotence).
    assert client.responses.cancel(response_id).model_dump() == stored.model_dump()


@pytest.mark.slow
def test_cancel_aborts_the_engine_request(server, client):
    resp = create(client, background=True, max_output_tokens=LONG)
    running(server, client, resp.id)
    cancelled = client.responses.cancel(resp.id)
    assert cancelled.status == "cancelled" and cancelled.id == resp.id
    no_request_left(server)
    assert client.responses.retrieve(resp.id).status == "cancelled"
    assert client.responses.cancel(resp.id).status == "cancelled"  # again: as it is


@pytest.mark.slow
def test_a_client_that_leaves_does_not_stop_it_a_follower_sees_the_rest(server, client):
    with create(client, background=True, stream=True, max_output_tokens=LONG) as stream:
        first = next(iter(stream))
    response_id = first.response.id  # the POST's connection is closed now
    running(server, client, response_id)
    time.sleep(0.5)
    assert client.responses.retrieve(response_id).status == "in_progress"
    follower = client.responses.retrieve(response_id, stream=True, starting_after=0)
    seen = []
    for event in follower:
        seen.append(event)
        if len(seen) == 5:
            break
    assert [e.sequence_number for e in seen] == [1, 2, 3, 4, 5]
    assert seen[0].type == "response.in_progress"
    # The rest of the events, followed live until the cancel ends the log.
    rest = client.responses.retrieve(response_id, stream=True, starting_after=5)
    cancelled = client.responses.cancel(response_id)
    assert cancelled.status == "cancelled" and cancelled.output[0].status == "incomplete"
    tail = list(rest)
    assert tail[0].sequence_number == 6 and tail[-1].type == "response.output_text.delta"
    no_request_left(server)


@pytest.mark.slow
def test_shutdown_ends_a_running_background_response(server, client):
    """Last: it stops the module's server. The drain waits --shutdown-timeout for it as
    for any request in flight, then ends it; the server exits 0."""
    resp = create(client, background=True, max_output_tokens=LONG)
    running(server, client, resp.id)
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert time.monotonic() - start < 15
    log = server.log_file.read_text()
    assert "Ending 1 request(s) still running" in log and "Traceback" not in log
