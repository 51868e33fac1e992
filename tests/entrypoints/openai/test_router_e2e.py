"""Two replicas behind vLLM's router (``vllm-router``, ``consistent_hash``): a job's turns,
named by ``X-Session-ID`` (the key the router hashes) and ``job_id``, all land on one
replica, whose Continuum pins give turns 2-3 their prefix; a job named by the header
alone is pinned too; a replica killed mid-job costs its job a re-route, not a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.entrypoints.openai.router_marks import ROUTER_E2E
from vllm.benchmarks.router import ReplicaSet

pytestmark = ROUTER_E2E

MODEL = "SmolLM2-135M-Instruct"
SERVE = (
    "--scheduling-policy", "continuum",
    "--continuum-default-ttl", "30",
    "--num-gpu-blocks-override", "128",
)  # fmt: skip
SYSTEM = "You are a coding agent. Reply with one short shell command."
TASKS = ["List the files.", "Show main.py.", "Check git status."]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    log_dir = os.environ.get("ROUTER_E2E_LOG_DIR") or str(tmp_path_factory.mktemp("router"))
    with ReplicaSet(2, SERVE, policy="consistent_hash", log_dir=log_dir) as replicas:
        yield replicas


def client(fleet: ReplicaSet):
    import openai

    return openai.OpenAI(base_url=fleet.base + "/v1", api_key="x", max_retries=0, timeout=60)


def counters(fleet: ReplicaSet, name: str) -> list[float]:
    """``name`` on each replica still alive (a dead one reads as None)."""
    out = []
    for replica in fleet.replicas:
        out.append(replica.metrics().get(name, 0.0) if replica.proc.poll() is None else None)
    return out


def moved(fleet, name: str, before: list, timeout_s: float = 5.0) -> list[int]:
    """The replicas whose ``name`` has grown past ``before`` (polled briefly: a counter
    may be written just after the response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = counters(fleet, name)
        grew = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a and a > b]
        if grew or time.monotonic() > deadline:
            return grew
        time.sleep(0.2)


def turn(fleet, session: str, messages: list, job_id: str | None) -> tuple[int, int]:
    """One turn through the router; (replica that served it, cached prompt tokens)."""
    before = counters(fleet, "vllm:prompt_tokens_total")
    resp = client(fleet).chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_headers={"X-Session-ID": session},
        extra_body={"job_id": job_id} if job_id else None,
    )
    grew = moved(fleet, "vllm:prompt_tokens_total", before)
    assert len(grew) == 1, f"prompt tokens moved on replicas {grew}"
    messages.append({"role": "assistant", "content": resp.choices[0].message.content})
    messages.append({"role": "user", "content": "Output:\nmain.py\nREADME.md"})
    return grew[0], resp.usage.prompt_tokens_details.cached_tokens


def run_job(fleet, session: str, job_id: str | None, turns: int = 3):
    messages = [{"role": "system", "content": SYSTEM}]
    served = []
    for task in TASKS[:turns]:
        messages.append({"role": "user", "content": task})
        served.append(turn(fleet, session, messages, job_id))
    return served, messages


def test_a_job_stays_on_one_replica_and_hits_its_pins(fleet):
    hits = counters(fleet, "vllm:pin_hits_total")
    served, _ = run_job(fleet, "job-a", "job-a")
    replicas = {r for r, _ in served}
    assert len(replicas) == 1, served
    (home,) = replicas
    assert all(cached > 0 for _, cached in served[1:]), served
    assert counters(fleet, "vllm:pin_hits_total")[home] - hits[home] == 2


def test_the_session_header_alone_names_the_job_on_the_replica(fleet):
    # No job_id: Continuum pins only named jobs, so these pin hits prove that the
    # replica took X-Session-ID as the job the router routed by.
    hits = counters(fleet, "vllm:pin_hits_total")
    served, _ = run_job(fleet, "session-b", None)
    (home,) = {r for r, _ in served}
    assert counters(fleet, "vllm:pin_hits_total")[home] - hits[home] == 2


def test_a_killed_replica_s_job_finishes_on_the_other(fleet):
    served, messages = run_job(fleet, "job-c", "job-c", turns=1)
    home = served[0][0]
    os.killpg(fleet.replicas[home].proc.pid, signal.SIGKILL)  # a crash, not a drain
    fleet.replicas[home].proc.wait(10)
    start = time.monotonic()
    for task in TASKS[1:]:
        messages.append({"role": "user", "content": task})
        replica, cached = turn(fleet, "job-c", messages, "job-c")
        assert replica != home
    assert cached > 0  # turn 3 found turn 2's prefix on its new replica
    assert time.monotonic() - start < 60, "the re-route took too long"
