"""`vllm serve --data-parallel-size 2` on the CPU: two engines behind two API servers (the
default, as in vLLM), or one. A job's turns stay on the engine that holds its KV
(Continuum pins it there) whichever API server takes them, X-data-parallel-rank picks an
engine, utility calls reach both, /metrics has each engine's series (the engine label),
and each engine publishes its KV events on its own endpoint (vLLM's port + rank)."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest
import requests
import zmq

from tests.test_kv_events_publisher import DECODER, subscriber
from vllm.benchmarks.server import RemoteServer
from vllm.entrypoints.utils import get_open_port

pytestmark = pytest.mark.slow

SYSTEM = "You are a coding agent working in a large repository. " * 8


def free_port_pair() -> int:
    """A port whose successor is free too (rank 1 publishes there)."""
    for _ in range(50):
        port = get_open_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def events_port():
    return free_port_pair()


@pytest.fixture(scope="module")
def server(tmp_path_factory, events_port):
    log = str(tmp_path_factory.mktemp("dp") / "server.log")
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}"}
    with RemoteServer(
        "-dp", "2", "--scheduling-policy", "continuum", "--continuum-default-ttl", "60",
        "--max-model-len", "1024",
        "--num-gpu-blocks-override", "256", "--kv-events-config", json.dumps(events),
        "--enable-log-requests",
        log_path=log, env={"VLLM_SERVER_DEV_MODE": "1"},
    ) as srv:  # fmt: skip
        srv.log_path = log
        yield srv


def api_server_of(server, response: requests.Response) -> str:
    """Which API server took the request (its log line's ``[api i]``)."""
    rid = response.json()["id"]
    with open(server.log_path) as f:
        for line in f:
            if f"Received request {rid}" in line:
                return re.search(r"\[api (\d+)\]", line).group(1)
    raise AssertionError(f"{rid} is not in the server's log")


@pytest.fixture(scope="module")
def subscribers(server, events_port):
    """A subscriber on each rank's endpoint: the port, and the port + 1."""
    ctx = zmq.Context()
    subs = [subscriber(ctx, f"tcp://127.0.0.1:{events_port + rank}") for rank in (0, 1)]
    time.sleep(0.5)  # ZeroMQ's slow joiner
    yield subs
    ctx.destroy(linger=0)


def session_ids(sub) -> tuple[set, set]:
    """The jobs whose blocks a rank published, and the ranks its batches name."""
    jobs, ranks = set(), set()
    while sub.poll(1000):
        batch = DECODER.decode(sub.recv_multipart()[2])
        ranks.add(batch.data_parallel_rank)
        # (the KV cache's blocks: the CPU tier's name no job)
        jobs |= {e.session_id for e in batch.events if getattr(e, "medium", None) == "GPU"}
    return jobs, ranks


def chat(server, job: str, messages: list, rank: int | None = None) -> requests.Response:
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else None
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "job_id": job}
    return requests.post(
        f"{server.base}/v1/chat/completions", json=body, headers=headers, timeout=120
    )


def gauge(server, name: str) -> dict[str, float]:
    """Each engine's value of a gauge (its ``engine`` label, as vLLM's)."""
    text = requests.get(f"{server.base}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            values[re.search(r'engine="(\d+)"', line).group(1)] = float(line.split()[-1])
    return values


def test_a_jobs_turns_stay_on_the_engine_with_its_kv(server, subscribers):
    jobs = {}
    for j in "AB":
        jobs[j] = [{"role": "system", "content": SYSTEM + j},
                   {"role": "user", "content": f"Task {j}: list the files."}]  # fmt: skip
    for rank, job in enumerate("AB"):  # A on engine 0, B on engine 1
        first = chat(server, job, jobs[job], rank=rank)
        assert first.status_code == 200, first.text
        reply = first.json()["choices"][0]["message"]["content"]
        jobs[job] += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go."}]
    # Sent one after the other with both engines idle, B's turn would go to engine 0 by
    # load alone; it follows its job to engine 1, where its history is, whichever of the
    # two API servers took it (each request is a new connection; the kernel hands it to
    # either). The second server learns the job's engine from the shared job table.
    servers = set()
    for attempt in range(16):
        for job in "BA":
            turn = chat(server, job, jobs[job])
            assert turn.status_code == 200, turn.text
            cached = turn.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 96, f"job {job} missed its history ({cached} tokens cached)"
            servers.add(api_server_of(server, turn))
        if len(servers) == 2 and attempt >= 1:
            break
    assert servers == {"0", "1"}, f"every turn reached API server {servers}"
    # Each engine has its own series (vLLM's engine label): Continuum pins each job's last
    # turn on its engine.
    assert gauge(server, "vllm:num_requests_running") == {"0": 0, "1": 0}
    assert gauge(server, "vllm:num_pinned_requests") == {"0": 1, "1": 1}
    # Each rank publishes its own KV events on its own endpoint: A's blocks on rank 0's,
    # B's on rank 1's.
    assert session_ids(subscribers[0]) == ({"A"}, {0})
    assert session_ids(subscribers[1]) == ({"B"}, {1})
    # A utility call reaches both engines: a pause that clears the cache ends the pins
    # and empties both prefix caches.
    assert requests.post(f"{server.base}/pause", timeout=60).status_code == 200
    assert requests.get(f"{server.base}/is_paused", timeout=60).json() == {"is_paused": True}
    assert requests.post(f"{server.base}/resume", timeout=60).status_code == 200
    assert requests.get(f"{server.base}/is_paused", timeout=60).json() == {"is_paused": False}
    for job in "AB":
        again = chat(server, job, jobs[job])
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_rank_that_is_not_one_is_a_400(server):
    for value in ("2", "x"):
        bad = requests.post(
            f"{server.base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"X-data-parallel-rank": value},
            timeout=60,
        )
        assert bad.status_code == 400 and "rank" in bad.json()["error"]["message"], bad.text
    ok = chat(server, "C", [{"role": "user", "content": "hi"}], rank=1)
    assert ok.status_code == 200


def children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # after the name: state, ppid
                found.add(int(entry))
    return found


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_an_engine_that_dies_takes_the_server_down_with_nothing_left(tmp_path, api_servers):
    import signal

    log = tmp_path / "server.log"
    server = RemoteServer(
        "-dp", "2", "--api-server-count", api_servers, "--max-model-len", "512",
        log_path=str(log),
    )  # fmt: skip
    try:
        found = re.search(r"pids ([\d, ]+)\)", log.read_text())
        pids = [int(p) for p in found.group(1).split(", ")]
        family = children(server.proc.pid)  # the engines, and the API servers if several
        assert set(pids) <= family and len(family) >= len(pids) + int(api_servers) - 1
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and server.proc.poll() is None:
            time.sleep(0.2)
        assert server.proc.poll() is not None, "the server outlived an engine"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pids[0]}"):
            time.sleep(0.2)
        left = {p for p in family if os.path.exists(f"/proc/{p}")}
        while time.monotonic() < deadline and left:
            time.sleep(0.2)
            left = {p for p in left if os.path.exists(f"/proc/{p}")}
        assert not left, f"processes left behind: {left} (rank 0's engine: {pids[0]})"
    finally:
        server.stop()
