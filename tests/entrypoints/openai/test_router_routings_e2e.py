"""Two replicas behind vLLM's router (``vllm-router``) in the routings run_sweep compares
beyond ``consistent_hash`` (test_router_e2e.py): the router's Program layer
(``--enable-program-scheduling``, run_sweep's ``--routing-policy program``),
``cache_aware``, and ``kv_aware`` fed by the replicas' KV cache events. Each turn's
replica is the ``x-vllm-instance`` header of its response, which the router passes
through."""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests

from our_experiments.scripts.workload import identity_fields
from tests.entrypoints.openai.router_marks import ROUTER_E2E
from vllm.benchmarks.router import ReplicaSet, program_scheduling_config
from vllm.entrypoints.utils import INSTANCE_HEADER

pytestmark = ROUTER_E2E

MODEL = "SmolLM2-135M-Instruct"
BLOCKS = 128
SERVE = (
    "--scheduling-policy", "continuum",
    "--continuum-default-ttl", "30",
    "--num-gpu-blocks-override", str(BLOCKS),
)  # fmt: skip
SYSTEM = "You are a coding agent. Reply with one short shell command."
TASKS = ["List the files.", "Show main.py.", "Check git status."]


def _log_dir(tmp_path_factory, name: str) -> Path:
    root = os.environ.get("ROUTER_E2E_LOG_DIR")
    return Path(root) / name if root else tmp_path_factory.mktemp(name)


@pytest.fixture(scope="module")
def program_fleet(tmp_path_factory):
    config = program_scheduling_config(BLOCKS * 16)
    log_dir = _log_dir(tmp_path_factory, "program")
    with ReplicaSet(
        2, SERVE, policy="program", program_config=config, log_dir=str(log_dir)
    ) as fleet:
        yield fleet


def _debug_fleet(tmp_path_factory, policy: str):
    """Two replicas behind the router with ``policy``, its debug log (where it says per
    request how it decided) kept: (the fleet, the log folder)."""
    log_dir = _log_dir(tmp_path_factory, policy)
    with ReplicaSet(
        2, SERVE, policy=policy, router_args=["--log-level", "debug"], log_dir=str(log_dir)
    ) as fleet:
        yield fleet, log_dir


@pytest.fixture(scope="module")
def cache_aware_fleet(tmp_path_factory):
    yield from _debug_fleet(tmp_path_factory, "cache_aware")


@pytest.fixture(scope="module")
def kv_aware_fleet(tmp_path_factory):
    # Each replica publishes its KV cache events; the router subscribes to them all.
    yield from _debug_fleet(tmp_path_factory, "kv_aware")


def client(fleet: ReplicaSet):
    import openai

    return openai.OpenAI(base_url=fleet.base + "/v1", api_key="x", max_retries=0, timeout=60)


def replica_index(fleet: ReplicaSet, instance: str) -> int:
    return [urlparse(r.base).netloc for r in fleet.replicas].index(instance)


def pin_hits(fleet: ReplicaSet) -> list[float]:
    return [r.metrics().get("vllm:pin_hits_total", 0.0) for r in fleet.replicas]


def run_job(fleet: ReplicaSet, job: str, identity: str) -> list[tuple[int, int]]:
    """A 3-turn job through the router: (replica, cached prompt tokens) of each turn."""
    messages = [{"role": "system", "content": SYSTEM}]
    served = []
    for step, task in enumerate(TASKS):
        messages.append({"role": "user", "content": task})
        raw = client(fleet).chat.completions.with_raw_response.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            **identity_fields(identity, job, last=step == len(TASKS) - 1, step=step),
        )
        resp = raw.parse()
        served.append(
            (
                replica_index(fleet, raw.headers[INSTANCE_HEADER]),
                resp.usage.prompt_tokens_details.cached_tokens,
            )
        )
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        messages.append({"role": "user", "content": "Output:\nmain.py\nREADME.md"})
    return served


def test_the_program_layer_binds_a_job_to_one_replica_which_pins_it(program_fleet):
    # The body carries vllm_xargs.agentic_context (program_id, session_id, step_id,
    # expected_resume): the router forwards it unchanged, and the replica names the job
    # by program_id, so Continuum pins its KV between turns.
    jobs = ["program-a", "program-b", "program-c"]
    for job in jobs:
        hits = pin_hits(program_fleet)
        served = run_job(program_fleet, job, "program_id")
        (home,) = {replica for replica, _ in served}
        assert all(cached > 0 for _, cached in served[1:]), served
        assert pin_hits(program_fleet)[home] - hits[home] == 2
    # Every turn went through the Program layer (not the consistent_hash fallback): each
    # replica's rolling samples count the requests it dispatched and completed; and it
    # reads our /metrics (KV usage, running, waiting) for its admission.
    diagnostics = requests.get(program_fleet.base + "/scheduling/diagnostics", timeout=10).json()
    assert diagnostics["enabled"] and diagnostics["global_queue"]
    ranks = diagnostics["ranks"]
    assert sum(r["rolling"]["request_samples"] for r in ranks) == len(jobs) * len(TASKS)
    assert all(r["configured_token_capacity"] == BLOCKS * 16 for r in ranks)
    assert all(r["vllm_kv_cache_usage"] is not None for r in ranks), ranks


def test_render_gives_the_prompt_token_ids_the_chat_runs_with(cache_aware_fleet):
    fleet, _ = cache_aware_fleet
    body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}]}
    body["messages"].append({"role": "user", "content": TASKS[0]})
    replica = fleet.replicas[0].base
    rendered = requests.post(replica + "/v1/chat/completions/render", json=body, timeout=30)
    assert rendered.status_code == 200, rendered.text
    ran = requests.post(replica + "/v1/chat/completions", json={**body, "max_tokens": 1})
    assert len(rendered.json()["token_ids"]) == ran.json()["usage"]["prompt_tokens"]


def test_cache_aware_routes_a_job_by_its_token_prefix(cache_aware_fleet):
    # cache_aware asks each replica for the chat's token ids (/v1/chat/completions/render)
    # and sends it where its longest prefix went before: a job's later turns, whose
    # prompt extends the previous one, follow its first. X-Session-ID names the job on
    # the replica (cache_aware itself does not read it).
    fleet, log_dir = cache_aware_fleet
    for job in ("cache-a", "cache-b"):
        served = run_job(fleet, job, "x-session-id")
        assert len({replica for replica, _ in served}) == 1, served
        assert all(cached > 0 for _, cached in served[1:]), served
    log = (log_dir / "router.log").read_text()
    assert "Cache prefix decision" in log
    assert "Prefix input preparation unavailable" not in log


def test_ab_benchmark_reports_where_each_turn_ran(program_fleet, tmp_path):
    # A smoke run of run_sweep's router point (a few jobs): the turns per replica come from
    # the responses' x-vllm-instance, the counters from each replica's /metrics.
    from our_experiments.scripts import ab_benchmark

    argv = [
        "--base-url", program_fleet.base,
        "--policy", "continuum",
        "--jps", "1.5",
        "--duration", "2",
        "--turns", "3",
        "--max-tokens", "8",
        "--seed", "3",
        "--drain-timeout", "240",
        "--identity", "program_id",
        "--output", str(tmp_path / "r.json"),
    ]  # fmt: skip
    for replica in program_fleet.replicas:
        argv += ["--metrics-url", replica.base]
    summary = ab_benchmark.main(argv)
    jobs = summary["num_jobs"]
    assert jobs >= 1 and summary["num_failed"] == 0, summary["errors"]
    assert summary["identity"] == "program_id"
    assert sum(summary["turns_per_replica"].values()) == 3 * jobs
    assert summary["turn_moves"] == 0 and summary["jobs_with_turn_moves"] == 0
    rows = summary["replicas"]
    assert [row["turns"] for row in rows] == [
        summary["turns_per_replica"].get(row["instance"], 0) for row in rows
    ]
    assert sum(row["turns"] for row in rows) == 3 * jobs
    assert sum(row["pins"] for row in rows) == summary["metrics"]["pins"] == 2 * jobs


def test_kv_aware_follows_the_replicas_kv_cache_events(kv_aware_fleet):
    # A prefix computed on replica 1 (sent there directly, not through the router) is
    # announced by its BlockStored events; requests that share it then go to replica 1
    # through the router, and hit its cache. Without the events the router's tie-break
    # sends every new request to replica 0 (tests/benchmarks/test_router_flags.py).
    fleet, log_dir = kv_aware_fleet
    system = "You are a release engineer. Answer with the exact command to run, nothing else."
    for home in (1, 0):
        messages = [{"role": "system", "content": f"{system} Team {home}." * 3}]
        messages.append({"role": "user", "content": "Tag the release."})
        direct = (
            fleet.replicas[home]
            .client()
            .chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
        )
        assert direct.usage.prompt_tokens >= 48
        time.sleep(1.0)  # the step's events reach the router
        for question in ("Build the wheel.", "Publish it."):
            turn = [*messages[:1], {"role": "user", "content": question}]
            raw = client(fleet).chat.completions.with_raw_response.create(
                model=MODEL, messages=turn, max_tokens=4, temperature=0
            )
            cached = raw.parse().usage.prompt_tokens_details.cached_tokens
            assert replica_index(fleet, raw.headers[INSTANCE_HEADER]) == home
            assert cached >= 32, cached
    log = (log_dir / "router.log").read_text()
    assert "kv_index subscriber for" in log and "credited_prefix_tokens" in log


def test_a_job_routed_by_kv_events_stays_home_and_is_pinned(kv_aware_fleet):
    # An agent job: each turn extends the last, so the events of its previous turn draw it
    # back to its replica, where Continuum pinned its KV between turns.
    fleet, _ = kv_aware_fleet
    hits = pin_hits(fleet)
    served = run_job(fleet, "kv-job", "job_id")
    (home,) = {replica for replica, _ in served}
    assert all(cached > 0 for _, cached in served[1:]), served
    assert pin_hits(fleet)[home] - hits[home] == 2
