"""Smoke run of the study's scripts against the real server and model (a few jobs)."""

from __future__ import annotations

import json

import pytest

from our_experiments.scripts import ab_benchmark, pin_verify
from vllm.benchmarks.server import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(
        "--scheduling-policy",
        "continuum",
        "--num-gpu-blocks-override",
        "400",
        "--max-model-len",
        "4096",
        "--disable-log-requests",
    )
    yield srv
    srv.stop()


def test_pin_verify_passes_on_continuum(server, capsys):
    failures = pin_verify.verify(server.base, turns=3, gap_s=0.6, polls=2, seed=1)
    out = capsys.readouterr().out
    assert failures == [], out
    assert "Turn 3/3 (is_last_step=True)" in out and out.count("ok") >= 4


def test_ab_benchmark_smoke(server, tmp_path):
    out = tmp_path / "r.json"
    # ~3 jobs arriving within 2 s, 3 turns each, 8 tokens per answer. The URL in its
    # OpenAI form (.../v1), as a user writes it: it once failed on the 404 of /v1/metrics.
    summary = ab_benchmark.main(
        [
            "--base-url", server.url_for_openai,
            "--policy", "continuum",
            "--jps", "1.5",
            "--duration", "2",
            "--turns", "3",
            "--max-tokens", "8",
            "--seed", "3",
            "--drain-timeout", "240",
            "--output", str(out),
        ]
    )  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved == summary
    assert summary["num_jobs"] >= 1 and summary["num_failed"] == 0, summary["errors"]
    assert len(summary["job_durations"]) == summary["num_jobs"]
    prompts = summary["per_turn_avg_prompt_tokens"]
    assert list(prompts) == ["1", "2", "3"] and prompts["1"] < prompts["2"] < prompts["3"]
    m = summary["metrics"]
    # every non-last turn pins; a next turn reuses its context
    assert m["pins"] == 2 * summary["num_jobs"]
    assert m["generation_tokens"] <= 8 * 3 * summary["num_jobs"]
    assert summary["prefix_hit_rate"] > 0.3 and summary["kv_usage_max"] > 0
    assert summary["per_turn_avg_cached_tokens"]["3"] > 0


def test_the_sweep_s_warm_up_reaches_the_server_before_the_workload(server):
    # run_sweep's warm-up (kernels compiled before a point's window): distinct prompts of
    # spread lengths, each sent twice (then extended); the workload's counters are deltas
    # taken after it.
    from our_experiments.scripts import run_sweep
    from vllm.benchmarks.metrics_reader import scrape_metrics

    prompts = run_sweep.warmup_prompts(3, 600)
    assert len({p.split(":")[0] for p in prompts}) == 3
    assert len(prompts[0]) < len(prompts[1]) < len(prompts[2])
    before = scrape_metrics(server.base)
    took = run_sweep.warm_up([server.base], 3, 600)
    after = scrape_metrics(server.base)
    done = "vllm:e2e_request_latency_seconds_count"
    assert after[done] - before.get(done, 0) == 6 and took > 0
    # The longest prompt stays within its token budget (the served tokenizer counts).
    prompt_tokens = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert prompt_tokens <= 2 * 3 * 600


def test_the_warm_up_fits_the_pool_and_the_model_length():
    # A pool of 200 blocks (3,200 tokens) under max_model_len 6,144: the longest prompt is a
    # quarter of the pool (it once asked 3,992 tokens of a 3,184-token pool: the CPU study
    # smoke run, session 22).
    from our_experiments.scripts import run_sweep

    args = run_sweep.make_parser().parse_args(["--num-gpu-blocks", "200"])
    assert run_sweep.warmup_tokens(args) == 800
    args = run_sweep.make_parser().parse_args(["--num-gpu-blocks", "1000"])
    assert run_sweep.warmup_tokens(args) == 1536
    longest = run_sweep.warmup_prompts(16, 800)[-1]
    assert len(longest.split()) * run_sweep.WORD_TOKENS <= 800 + 3 * run_sweep.WORD_TOKENS
