"""The short soak in CI: clients that disconnect, time out, abort or never send their last
step leave no running, waiting or pinned request, no KV usage and no RSS growth behind,
and the server still serves a new job (benchmarks/benchmark_soak.py; docs/benchmarks.md).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.utils import load_script
from vllm.benchmarks.server import RemoteServer

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "benchmark_soak.py"
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_pinned_requests")


def load_soak():
    """benchmarks/ is a folder of scripts, not a package: load the script by its path."""
    return load_script(SCRIPT)


def test_short_soak_leaves_nothing_behind(tmp_path):
    soak = load_soak()
    log = tmp_path / "server.log"
    args = soak.parse_args(["--duration", "20", "--seed", "1", "--server-log", str(log)])
    report = soak.run_soak(args)
    soak.print_report(report, args)  # shown by pytest on failure, with the server log's path
    assert report.leaks == [], f"server log: {log}"
    tally = report.tally
    # The soak exercised what it claims: every kind of client, and real early exits.
    assert all(tally.jobs[kind] > 0 for kind in soak.KINDS), tally.jobs
    assert sum(tally.aborts.values()) > 0, tally.aborts
    assert report.final.latency_s is not None


def test_new_job_is_served_on_an_idle_server_after_abandoned_jobs():
    server = RemoteServer(
        "--scheduling-policy", "continuum", "--num-gpu-blocks-override", "64",
        "--continuum-default-ttl", "1", "--continuum-max-ttl", "3",
    )  # fmt: skip
    try:
        client = server.client(timeout=120)
        # 3 jobs of ~130 prompt tokens that never send their last step: each reserves its
        # context + 256 tokens of growth, 3 x ~390 > the 1,008 tokens of the pool.
        for j in range(3):
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"job {j} " + "word " * 100}],
                max_tokens=8,
                extra_body={"job_id": f"abandoned-{j}", "is_last_step": False},
            )
        time.sleep(4)  # past the 3 s maximum TTL: nothing runs, waits or is pinned
        m = server.metrics()
        assert [m[g] for g in IDLE_GAUGES] == [0, 0, 0] and m["vllm:kv_cache_usage_perc"] == 0
        resp = server.client(timeout=15).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            extra_body={"job_id": "new", "is_last_step": True},
        )
        assert resp.choices[0].message.content
    finally:
        server.stop()
